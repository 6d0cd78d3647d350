"""Peak extra memory of one CPU forward where attention masks and position biases used to cost the
most: (a) one long causal text through a tiny random Qwen3-shaped decoder, (b) a 256-item MPNet
batch of mixed lengths, (c) one long text through ModernBERT's local (windowed) layers.

    .venv/bin/python bench/attention_memory.py            # all cases
    .venv/bin/python bench/attention_memory.py --case mpnet
    PYTHONPATH=/tmp/other-checkout/src .venv/bin/python bench/attention_memory.py  # another checkout

Each case runs in a fresh interpreter with glibc's mmap threshold pinned (MALLOC_MMAP_THRESHOLD_),
so every large tensor is mmapped and handed back to the OS when freed: the resident set then tracks
live tensor memory. The figure is the high-water mark (VmHWM, reset through /proc/self/clear_refs
just before the forward) minus the resident set before it: every byte the forward allocated at its
peak, masks, biases, activations and kernel workspace alike. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CASES = ("llama", "mpnet", "modernbert")
LONG_TEXT_TOKENS = 4096
MPNET_ITEMS, MPNET_LENGTHS = 256, (16, 256)  # lengths drawn uniformly from this range


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_extra_bytes(forward) -> int:
    """Bytes the process's resident set grew by at its peak while `forward()` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status_kb("VmRSS")
    forward()
    return (_status_kb("VmHWM") - before) * 1024


def build_case(case: str):
    """(model, inputs, description) for one case, random weights, fp32."""
    import torch

    from shoal.layers import AttentionMeta, PackedInputs

    torch.manual_seed(0)
    if case == "llama":
        from shoal.models.llama import LlamaConfig, LlamaModel

        cfg = LlamaConfig(
            model_type="qwen3",
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            qk_norm=True,
        )
        model, lengths = LlamaModel(cfg), [LONG_TEXT_TOKENS]
        heads = cfg.num_attention_heads
    elif case == "mpnet":
        from shoal.models.mpnet import MPNetConfig, MPNetModel

        cfg = MPNetConfig(
            vocab_size=1000,
            hidden_size=192,
            num_hidden_layers=2,
            num_attention_heads=12,
            intermediate_size=384,
            max_position_embeddings=MPNET_LENGTHS[1] + 2,
        )
        model = MPNetModel(cfg)
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(MPNET_LENGTHS[0], MPNET_LENGTHS[1] + 1, (MPNET_ITEMS,), generator=g).tolist()
        heads = cfg.num_attention_heads
    elif case == "modernbert":
        from shoal.models.modernbert import ModernBertConfig, ModernBertModel

        cfg = ModernBertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=256,
            global_layers=(True, False, False),
        )
        model, lengths = ModernBertModel(cfg), [LONG_TEXT_TOKENS]
        heads = cfg.num_attention_heads
    else:
        raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    model.eval()
    L = max(lengths)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    input_ids = torch.randint(2, 1000, (int(cu_seqlens[-1]),))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMeta.build(cu_seqlens, L)
    info = dict(
        case=case,
        num_seqs=len(lengths),
        max_seqlen=L,
        num_tokens=int(cu_seqlens[-1]),
        heads=heads,
        layers=cfg.num_hidden_layers,
        # the [n, H, L, L] fp32 tensor a per-batch bias or mask would cost
        nHLL_fp32_bytes=len(lengths) * heads * L * L * 4,
    )
    return model, PackedInputs(input_ids, position_ids, meta), info


def run_case(case: str) -> dict:
    """Builds the case and measures one forward, in this process."""
    import torch

    from shoal.layers import AttentionMeta, PackedInputs

    torch.set_num_threads(1)  # per-thread kernel workspace stays one thread's, run to run
    model, inputs, info = build_case(case)
    with torch.inference_mode():
        first = int(inputs.meta.cu_seqlens[1])
        warm = AttentionMeta.build(inputs.meta.cu_seqlens[:2].clone(), first)  # first sequence only
        model(PackedInputs(inputs.input_ids[:first], inputs.position_ids[:first], warm))
        started = time.perf_counter()
        info["peak_extra_bytes"] = peak_extra_bytes(lambda: model(inputs))
        info["forward_s"] = round(time.perf_counter() - started, 2)
    import shoal

    info["shoal"] = str(Path(shoal.__file__).parent)
    return info


def measure_in_subprocess(case: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--case", case, "--here"], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--here", action="store_true", help="measure in this process (used by the parent)")
    args = parser.parse_args()
    if args.here:
        print(json.dumps(run_case(args.case[0])))
        return
    for case in args.case or CASES:
        r = measure_in_subprocess(case)
        print(
            f"{r['case']:>10}: n={r['num_seqs']} L={r['max_seqlen']} T={r['num_tokens']} H={r['heads']} "
            f"layers={r['layers']}  peak extra {r['peak_extra_bytes']:,} B "
            f"({r['peak_extra_bytes'] / 2**20:.1f} MiB; n*H*L*L*4 = {r['nHLL_fp32_bytes'] / 2**20:.0f} MiB)  "
            f"forward {r['forward_s']} s  [{r['shoal']}]"
        )


if __name__ == "__main__":
    main()
