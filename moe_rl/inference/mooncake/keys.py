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

__all__ = ["KINDS", "SEPARATOR", "StoreKey", "kv_block_key", "kv_chain_hashes", "parse_shard", "shard_id"]

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


def _check_block_size(where: str, block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}: block_size={block_size!r} must be an int >= 1 (the engine's KV block size)")


def kv_block_key(*, model: str, cache_salt: str | None, weight_version: int | None, kv_dtype: str, block_size: int,
                 layout: str, rank: int, world: int, chain_hash: str) -> StoreKey:
    """The key of one KV-cache block (one shard of it) in the Mooncake KV tier (``kv_connector``).

    Layout: ``moe_rl|k1|kv|<model>|s<salt digest>|<kv_dtype>|<rank>of<world>|w<version>.bs<block_size>.<layout>.
    <chain_hash>|p0``. Every field that changes the KV bytes is in the key, so a lookup under another model, weight
    version, ``cache_salt``, KV dtype, block size, cache layout or shard misses instead of loading foreign KV.

    Args:
        model: served model id (no ``|`` or whitespace).
        cache_salt: the request's vLLM ``cache_salt`` (None: unsalted); stored as the first 16 hex digits of its
            SHA-256 (``"none"`` when None), so arbitrary salt text is allowed.
        weight_version: the engine's weight version (int >= 0), or None when unknown (``"wx"``).
        kv_dtype: the KV cache dtype (``"float32"``, ``"bfloat16"``, ``"fp8_e4m3"``, ...).
        block_size: tokens per KV block (>= 1).
        layout: a fingerprint of the KV cache geometry (layers, heads, head size), without ``.``/``|``/whitespace.
        rank, world: this shard's global rank among ``world`` (tensor x pipeline parallel) workers.
        chain_hash: hex digest of the token prefix ending with this block (:func:`kv_chain_hashes`).

    Raises:
        ValueError: a negative version, ``block_size < 1``, a bad shard, a component with ``|``/whitespace, an empty
            component.
        TypeError: a component of the wrong type.
    """
    import hashlib

    if weight_version is not None and (isinstance(weight_version, bool) or not isinstance(weight_version, int)
                                       or weight_version < 0):
        raise ValueError(f"kv_block_key: weight_version={weight_version!r} must be None or an int >= 0")
    _check_block_size("kv_block_key", block_size)
    for field, value in (("layout", layout), ("chain_hash", chain_hash)):
        if not isinstance(value, str) or not value or "." in value:
            raise ValueError(f"kv_block_key: {field}={value!r} must be a non-empty str without '.'")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"kv_block_key: cache_salt={cache_salt!r} must be a str or None")
    salt = "none" if cache_salt is None else hashlib.sha256(cache_salt.encode()).hexdigest()[:16]
    version = "x" if weight_version is None else str(weight_version)
    return StoreKey(kind="kv", model=model, dtype=kv_dtype, salt=salt, shard=shard_id(rank, world),
                    name=f"w{version}.bs{block_size}.{layout}.{chain_hash}")


def kv_chain_hashes(token_ids: list[int] | tuple[int, ...], block_size: int, num_blocks: int) -> list[str]:
    """Chained SHA-256 digests (32 hex digits each) of the first ``num_blocks`` full blocks of ``token_ids``: digest
    ``i`` covers tokens ``[0, (i + 1) * block_size)``, so equal digests mean equal prefixes. Process-independent
    (unlike vLLM's block hashes, whose seed is random unless ``PYTHONHASHSEED`` is set).

    Raises:
        ValueError: ``block_size < 1``, ``num_blocks * block_size > len(token_ids)``, a negative ``num_blocks``, or
            a token id that is not an int in the signed 64-bit range.
    """
    import hashlib
    import struct

    _check_block_size("kv_chain_hashes", block_size)
    if num_blocks < 0 or num_blocks * block_size > len(token_ids):
        raise ValueError(f"kv_chain_hashes: num_blocks={num_blocks} x block_size={block_size} exceeds the "
                         f"{len(token_ids)} tokens given")
    out: list[str] = []
    parent = b"moe_rl-kv-chain"
    for i in range(num_blocks):
        block = token_ids[i * block_size:(i + 1) * block_size]
        try:
            packed = struct.pack(f"<{block_size}q", *block)
        except struct.error as exc:
            raise ValueError(f"kv_chain_hashes: token_ids[{i * block_size}:{(i + 1) * block_size}] = {list(block)!r} "
                             f"must be ints in the signed 64-bit range ({exc})") from exc
        parent = hashlib.sha256(parent + packed).digest()
        out.append(parent.hex()[:32])
    return out
