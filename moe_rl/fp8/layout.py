"""DeepGEMM scale-factor (SF) layouts, in torch: MN-major TMA-aligned fp32 and packed UE8M0 int32.

Semantics follow DeepGEMM (``deep_gemm/utils/layout.py``, ``csrc/apis/layout.hpp`` and the torch reference
``get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl`` in its ``tests/test_layout.py``); the code is ours.

Shape legend:
    MN  rows of the scale grid (M tokens for the LHS, N for a per-row RHS)
    SK  scale columns along K, SK = ceil(K / 128)
    AM  MN padded for TMA: ``get_tma_aligned_size(MN, elem_bytes)`` (multiple of 16 bytes)
    PK  packed columns, PK = ceil(SK / 4)
    G   optional leading group (expert) dimension

Layouts::

    K-major (what the quantizers return)      sf[mn, sk] at offset mn * SK + sk          (row-major)
    MN-major, TMA aligned (SFA on SM90)       sf[mn, sk] at offset sk * AM + mn          shape [MN, SK],
                                              strides (1, AM); rows MN..AM-1 are padding (zero here)
    packed UE8M0, MN-major, TMA aligned       int32 p[mn, pk] = e[4pk] | e[4pk+1] << 8 | e[4pk+2] << 16
    (SM100)                                     | e[4pk+3] << 24, with e = the biased fp32 exponent byte of
                                              sf (bits 23..30; 2**(e-127)); SK padded to 4 with e = 0;
                                              offset pk * AM + mn, AM = get_tma_aligned_size(MN, 4)

Example (MN=2, SK=3, fp32): AM = 4, storage = [s00, s10, 0, 0, s01, s11, 0, 0, s02, s12, 0, 0].
The byte order inside the int32 is that of DeepGEMM's reference, which views little-endian uint8 as int32; we
compute it with shifts so the result does not depend on the host's endianness.
"""

from __future__ import annotations

import torch

__all__ = [
    "TMA_ALIGNMENT_BYTES",
    "from_mn_major",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "unpack_ue8m0",
]

TMA_ALIGNMENT_BYTES = 16
"""TMA needs the stride of the non-contiguous dimension to be a multiple of 16 bytes (DeepGEMM)."""


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """Round ``x`` elements of ``element_size`` bytes up to a multiple of 16 bytes (4 for fp32/int32).

    Raises:
        ValueError: ``element_size`` does not divide 16, or ``x`` < 0.
    """
    if element_size < 1 or TMA_ALIGNMENT_BYTES % element_size:
        raise ValueError(f"element_size={element_size}: must divide {TMA_ALIGNMENT_BYTES} (1, 2, 4, 8 or 16)")
    if x < 0:
        raise ValueError(f"x={x}: must be >= 0")
    align = TMA_ALIGNMENT_BYTES // element_size
    return -(-x // align) * align


def _as_3d(sf: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    if sf.dim() not in (2, 3):
        raise ValueError(f"{name}: expected [MN, SK] or [G, MN, SK], got shape {tuple(sf.shape)}")
    return (sf.unsqueeze(0), True) if sf.dim() == 2 else (sf, False)


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Return fp32 scales ``[(G,) MN, SK]`` in the MN-major (column-major), TMA-aligned layout.

    Same values and shape as ``sf``; strides ``(1, AM)`` (or ``(SK * AM, 1, AM)`` with groups), where
    ``AM = get_tma_aligned_size(MN, 4)``. The storage padding rows are zero-filled (DeepGEMM leaves them
    uninitialised on some paths; zeros make the storage deterministic and comparable in tests).
    """
    if sf.dtype != torch.float32:
        raise ValueError(f"sf: dtype {sf.dtype}; the fp32 MN-major layout needs float32 scales")
    x, squeeze = _as_3d(sf, "sf")
    G, MN, SK = x.shape
    AM = get_tma_aligned_size(MN, 4)
    storage = torch.zeros((G, SK, AM), dtype=torch.float32, device=sf.device)
    storage[:, :, :MN] = x.transpose(1, 2)
    out = storage.transpose(1, 2)[:, :MN, :]
    return out.squeeze(0) if squeeze else out


def from_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """Contiguous (K-major) copy of an MN-major tensor, e.g. to compare against the quantizer output."""
    return sf.contiguous()


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales ``[(G,) MN, SK]`` into int32 UE8M0 ``[(G,) MN, ceil(SK/4)]``, MN-major.

    Four consecutive K-scales share one int32 (lowest byte = lowest k). The result has strides ``(1, AM)``
    with ``AM = get_tma_aligned_size(MN, 4)``; padding (rows >= MN, exponents for k >= SK) is zero.

    Raises:
        ValueError: ``sf`` is not fp32, or holds a value that is not a positive *normal* power of two
            (UE8M0 stores an exponent only: quantize with ``ue8m0=True``).
    """
    if sf.dtype != torch.float32:
        raise ValueError(f"sf: dtype {sf.dtype}; UE8M0 packing needs float32 power-of-two scales")
    bits = sf.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    bad = (sf <= 0) | ((bits & 0x7FFFFF) != 0) | (exp == 0) | (exp == 0xFF)
    n_bad = int(bad.sum())
    if n_bad:
        raise ValueError(
            f"sf: {n_bad} value(s) are not positive normal powers of two, so they have no exact UE8M0 "
            "encoding; quantize with ue8m0=True"
        )
    x, squeeze = _as_3d(exp, "sf")
    G, MN, SK = x.shape
    AM = get_tma_aligned_size(MN, 4)
    PK = -(-SK // 4)
    e = torch.zeros((G, MN, PK * 4), dtype=torch.int64, device=sf.device)
    e[:, :, :SK] = x
    e = e.view(G, MN, PK, 4)
    packed = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)  # [G, MN, PK], < 2**32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # reinterpret as int32
    storage = torch.zeros((G, PK, AM), dtype=torch.int32, device=sf.device)
    storage[:, :, :MN] = packed.transpose(1, 2)
    out = storage.transpose(1, 2)[:, :MN, :]
    return out.squeeze(0) if squeeze else out


def unpack_ue8m0(packed: torch.Tensor, sk: int) -> torch.Tensor:
    """Inverse of :func:`get_mn_major_tma_aligned_packed_ue8m0_tensor`: int32 ``[(G,) MN, PK]`` -> fp32
    ``[(G,) MN, sk]`` (contiguous), each value ``2 ** (e - 127)``.

    Raises:
        ValueError: ``packed`` is not int32 or ``sk`` does not fit ``PK = ceil(sk / 4)``.
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed: dtype {packed.dtype}; expected int32")
    x, squeeze = _as_3d(packed, "packed")
    G, MN, PK = x.shape
    if not (0 < sk and -(-sk // 4) == PK):
        raise ValueError(f"sk={sk}: packed has {PK} int32 columns, so sk must satisfy ceil(sk/4) == {PK}")
    v = x.to(torch.int64) & 0xFFFFFFFF
    e = torch.stack([(v >> (8 * j)) & 0xFF for j in range(4)], dim=-1).view(G, MN, PK * 4)[:, :, :sk]
    out = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=packed.device), (e - 127).to(torch.int32))
    return out.squeeze(0) if squeeze else out
