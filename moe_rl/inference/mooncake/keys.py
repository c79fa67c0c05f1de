"""Mooncake Store key scheme: one deterministic string per object, parseable back.

Layout (``|``-separated; ``|`` never occurs in HF tensor names, model ids, dtypes or rollout ids)::

    moe_rl|k1|<kind>|<model>|<generation>|<dtype>|<shard>|<name>|<part>

    kind        weights | routed_experts | kv
    model       model id, e.g. "zai-org/GLM-4.5-Air" (any text without '|' or whitespace)
    generation  "v<version>" (policy/weight version, int >= 0) or "s<cache_salt>" (vLLM cache_salt)
    dtype       payload dtype: a torch dtype name ("bfloat16", "float8_e4m3fn"), a KV dtype ("fp8_e4m3"),
                or a codec tag ("mrix1" for routed-experts records); never empty
    shard       "<rank>of<world>", e.g. "0of1" (whole tensor) or "3of8" (tensor-parallel rank 3 of 8)
    name        the object within that scope: HF tensor name, rollout id, "__manifest__"
    part        "p<i>": chunk i of an object split to fit the client's transfer buffer (p0 when unsplit)

``k1`` is the scheme version, so a reader can refuse keys written by a future layout. Keys are
compared as strings; two writers that agree on the components agree on the key (no instance id or
timestamp inside), so duplicate puts collide on purpose and are idempotent (``StoreClient.put_batch``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KINDS", "SEPARATOR", "StoreKey", "shard_id", "parse_shard"]

SEPARATOR = "|"
PREFIX = "moe_rl"
SCHEME = "k1"
KINDS = ("weights", "routed_experts", "kv")
_FORBIDDEN = re.compile(r"[|\s]")


def shard_id(rank: int, world: int) -> str:
    """``"<rank>of<world>"``; ``shard_id(0, 1)`` is the whole object.

    Raises:
        ValueError: ``world < 1`` or ``rank`` outside ``[0, world)``.
    """
    for name, v in (("rank", rank), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"shard_id: {name}={v!r} must be an int")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_id: rank={rank}, world={world}: need world >= 1 and 0 <= rank < world")
    return f"{rank}of{world}"


def parse_shard(text: str) -> tuple[int, int]:
    """Inverse of :func:`shard_id`: ``"3of8" -> (3, 8)``.

    Raises:
        ValueError: ``text`` is not ``<rank>of<world>`` with ``0 <= rank < world``.
    """
    m = re.fullmatch(r"(\d+)of(\d+)", text)
    if m is None:
        raise ValueError(f"shard={text!r} is not '<rank>of<world>' (e.g. '0of1'); build it with shard_id(rank, world)")
    rank, world = int(m.group(1)), int(m.group(2))
    if world < 1 or rank >= world:
        raise ValueError(f"shard={text!r}: need world >= 1 and 0 <= rank < world")
    return rank, world


def _check_component(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"StoreKey: {field}={value!r} has type {type(value).__name__}; expected str")
    if not value:
        raise ValueError(f"StoreKey: {field} is empty; every key component must be a non-empty string")
    bad = _FORBIDDEN.search(value)
    if bad:
        raise ValueError(
            f"StoreKey: {field}={value!r} contains {bad.group()!r} at position {bad.start()}; key components may "
            f"not contain the separator {SEPARATOR!r} or whitespace (rename it, e.g. replace it with '_')"
        )
    return value


@dataclass(frozen=True)
class StoreKey:
    """One Mooncake object's identity (see the module docstring for the string layout).

    Exactly one of ``version`` and ``salt`` is set. Build with keyword arguments; :meth:`to_str` /
    :meth:`parse` convert to and from the stored string.

    Raises (on construction):
        ValueError: an unknown ``kind``, an empty component, a component holding ``|`` or whitespace, a
            negative ``version``/``part``, both or neither of ``version``/``salt``, a malformed ``shard``.
        TypeError: a component of the wrong type.
    """

    kind: str
    model: str
    dtype: str
    name: str
    version: int | None = None
    salt: str | None = None
    shard: str = "0of1"
    part: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StoreKey: kind={self.kind!r} is not one of {KINDS}")
        for f in ("model", "dtype", "name", "shard"):
            _check_component(f, getattr(self, f))
        parse_shard(self.shard)
        if (self.version is None) == (self.salt is None):
            raise ValueError(
                f"StoreKey: pass exactly one of version (weight version) and salt (cache_salt); got "
                f"version={self.version!r}, salt={self.salt!r}"
            )
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int)
                                         or self.version < 0):
            raise ValueError(f"StoreKey: version={self.version!r} must be an int >= 0")
        if self.salt is not None:
            _check_component("salt", self.salt)
        if isinstance(self.part, bool) or not isinstance(self.part, int) or self.part < 0:
            raise ValueError(f"StoreKey: part={self.part!r} must be an int >= 0")

    @property
    def generation(self) -> str:
        """``v<version>`` or ``s<salt>``."""
        return f"v{self.version}" if self.version is not None else f"s{self.salt}"

    def to_str(self) -> str:
        """The stored key string."""
        return SEPARATOR.join((PREFIX, SCHEME, self.kind, self.model, self.generation, self.dtype, self.shard,
                               self.name, f"p{self.part}"))

    __str__ = to_str

    def with_part(self, part: int) -> StoreKey:
        """The same key for chunk ``part``."""
        return StoreKey(kind=self.kind, model=self.model, dtype=self.dtype, name=self.name, version=self.version,
                        salt=self.salt, shard=self.shard, part=part)

    @classmethod
    def parse(cls, text: str) -> StoreKey:
        """Inverse of :meth:`to_str`.

        Raises:
            ValueError: not 9 ``|``-separated fields, a foreign prefix or scheme, or an invalid component.
        """
        fields = text.split(SEPARATOR)
        if len(fields) != 9:
            raise ValueError(f"StoreKey.parse: {text!r} has {len(fields)} '|'-separated fields; expected 9")
        prefix, scheme, kind, model, gen, dtype, shard, name, part = fields
        if (prefix, scheme) != (PREFIX, SCHEME):
            raise ValueError(f"StoreKey.parse: {text!r} starts with {prefix}|{scheme}; expected {PREFIX}|{SCHEME}")
        if len(gen) < 2 or gen[0] not in "vs" or (gen[0] == "v" and not gen[1:].isdigit()):
            raise ValueError(f"StoreKey.parse: generation {gen!r} in {text!r} is not 'v<int>' or 's<salt>'")
        if not (part[:1] == "p" and part[1:].isdigit()):
            raise ValueError(f"StoreKey.parse: part {part!r} in {text!r} is not 'p<int>'")
        version = int(gen[1:]) if gen[0] == "v" else None
        salt = gen[1:] if gen[0] == "s" else None
        return cls(kind=kind, model=model, dtype=dtype, name=name, version=version, salt=salt, shard=shard,
                   part=int(part[1:]))
