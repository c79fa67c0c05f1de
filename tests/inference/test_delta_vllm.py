"""Delta-encoded weight versions (``trainer.weight_delta``) against one real vLLM CPU engine (in-process, tiny MoE).

Version 1 is published in full, versions 2-5 as deltas (random sparse changes to a random subset of tensors, so some
load units change and others do not); the engine loads each through ``load_sharded`` (host copy advanced, then only
the changed load units handed to vLLM's ``load_weights``). After the last delta the engine's greedy tokens and
log-probs must be bit-identical to a path reload of the same version written as a plain checkpoint
(``reload_and_repack``, which ``test_vllm_reload.py`` shows equals a fresh load). The watcher's jump (version 4 is
never loaded: version 5's load applies 4's delta first) and a refused corrupt delta are on the way.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _weight_versions import changed_version

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 4, 5, 13, 6, 15], [1] + list(range(3, 16)) * 3]
MAX_TOKENS = 10


def _step(sd: dict[str, torch.Tensor], gen: torch.Generator, frac: float = 0.03) -> dict[str, torch.Tensor]:
    """About ``frac`` of the elements of a random 40% of the tensors get new values (the tensor's own scale)."""

    def new_values(flat: torch.Tensor, k: int) -> torch.Tensor:
        return torch.randn(k, generator=gen, dtype=flat.dtype) * (float(flat.std()) if flat.numel() > 1 else 1)

    return changed_version(sd, gen, frac=frac, share=0.4, new_values=new_values)


def _pieces(sd: dict[str, torch.Tensor]):
    """Every tensor with dim 0 >= 2 in two pieces (two FSDP shards' worth), 0-d/1-row tensors whole."""
    from moe_rl.weights.regions import Piece

    out = []
    for n, t in sd.items():
        shape = tuple(t.shape)
        if t.dim() == 0 or shape[0] < 2:
            out.append(Piece(n, shape, (0,) * t.dim(), t.contiguous()))
            continue
        half = shape[0] // 2
        out.append(Piece(n, shape, (0,) * t.dim(), t[:half].contiguous()))
        out.append(Piece(n, shape, (half,) + (0,) * (t.dim() - 1), t[half:].contiguous()))
    return out


def test_delta_updates_match_a_fresh_load(vllm_engine, greedy, tiny_moe_dirs, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from moe_rl.weights.delta import DeltaError
    from moe_rl.weights.delta_sync import DeltaConfig
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, version_dir

    monkeypatch.delenv("MOE_RL_WEIGHTS_ROOT", raising=False)
    src = tiny_moe_dirs["v1"]
    gen = torch.Generator().manual_seed(0)
    sd = _step(load_file(str(src / "model.safetensors")), gen)
    root = tmp_path / "weights"
    pub = ShardedFilesystemPublisher(root, {"model_type": "glm4_moe"}, delta=DeltaConfig(enabled=True, full_every=100))
    with vllm_engine(src) as llm:
        before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="base")
        reports, published = [], []
        for v in range(1, 6):
            sd = sd if v == 1 else _step(sd, gen)
            st = pub.publish(_pieces(sd), v)
            published.append(st)
            assert st.extra["delta"]["full"] == (v == 1)
            if v == 3:  # a corrupt copy of version 3 is refused first; the engine stays on version 2, whole
                bad = tmp_path / "bad" / "step_3"
                shutil.copytree(version_dir(root, 3), bad)
                f = bad / "rank_00000.delta.safetensors"
                data = bytearray(f.read_bytes())
                data[-3] ^= 0x40
                f.write_bytes(bytes(data))
                shutil.copytree(version_dir(root, 2), bad.parent / "step_2")
                with pytest.raises(DeltaError):
                    llm.collective_rpc("load_sharded", args=(str(bad), 3))
                assert llm.collective_rpc("weight_version") == [2]
            if v == 4:
                continue  # the watcher jumped over it
            (rep,) = llm.collective_rpc("load_sharded", args=(str(version_dir(root, v)), v))
            reports.append(rep)
        got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="delta-5")
        assert reports[-1]["delta"]["versions"] == [4, 5]
        partial = [r for r in reports if r["tensors"] < r["delta"]["tensors_total"]]
        assert partial, "every delta load handed every tensor to vLLM: the changed-units path was not exercised"
        # the same version 5 as a plain checkpoint, path-reloaded
        ref_dir = tmp_path / "v5"
        shutil.copytree(src, ref_dir)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(ref_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        llm.collective_rpc("reload_and_repack", args=(str(ref_dir), 6))
        ref = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="path-6")
    assert got != before, "the updates did not change the outputs: the comparison would mean nothing"
    assert got == ref, "tokens or log-probs after the delta updates differ from a fresh load of the same version"
    full_bytes = published[0].bytes
    delta_bytes = [st.bytes for st in published[1:]]
    print(f"\nbytes per update: full {full_bytes}, deltas {delta_bytes} "
          f"({[round(b / full_bytes, 4) for b in delta_bytes]} of full); loaded tensors per delta load "
          f"{[(r['tensors'], r['delta']['tensors_total']) for r in reports[1:]]}")
    assert all(b < full_bytes for b in delta_bytes)
