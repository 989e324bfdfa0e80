"""Training throughput and MFU of mixerzoo's attention LM against transformers' LlamaForCausalLM (CPU, fp32).

Both models get the same shape (d_model, n_layers, heads, SwiGLU d_ff, vocab, RMSNorm, RoPE, causal SDPA,
untied head unless ``--tie``) and therefore the same parameter count, which the script checks and prints.
Each training step is the same for both: ``zero_grad -> forward -> cross-entropy over (B*T, V) -> backward ->
AdamW.step`` on the same fixed batch of random token ids.

Fairness on a loaded machine: the models are timed in interleaved repeats (order alternating ABBA) and the
reported ratio is the median over repeats of ``ours / llama`` from the same repeat. A large fp32 matmul is
timed with the same thread count before every repeat; its best observed rate is the peak for MFU.

FLOPs per trained token (PaLM, Chowdhery et al. 2022, appendix B; as in nanoGPT's ``estimate_mfu``)::

    6 * N + 12 * n_layers * d_model * seq_len

with ``N`` the parameters that take part in matmuls (every parameter except the input-embedding lookup
table; with tied embeddings the shared matrix counts once, for the head). The attention term counts the
full ``seq_len x seq_len`` score and value products (no causal discount), as the standard formula does.

Usage (from the repository root)::

    python benchmarks/run.py throughput                      # d_model 256, 4 layers, batch 4 x 512
    python benchmarks/run.py throughput --compile            # + torch.compile'd mixerzoo arm
    python benchmarks/run.py throughput --profile            # + torch.profiler top ops per model
    python benchmarks/run.py throughput --device cuda --dtype bf16 --d-model 768 --n-layers 12 \
        --n-heads 12 --seq-len 2048 --batch 8 --vocab 32000 --steps 5 --warmup 2 --repeats 5 --compile \
        --matmul-n 8192                                              # the ~120M GPU comparison

On a GPU the step runs under bf16 autocast (weights fp32, as Lightning's ``bf16-mixed``) with fused AdamW, the
timer waits for the device (``cuda.synchronize``), and the peak is a bf16 matmul's measured rate (or
``--peak-tflops``, e.g. 989 for an H100 SXM's dense bf16, for MFU against the data sheet).

It prints a table; it is not a test. Run through the runner (``benchmarks/run.py throughput``), which puts this
checkout first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from _device import add_device_args, autocast, check_device, sync  # beside this module
from mixerzoo.flops import flop_parameters, training_flops_per_token
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.channel_mixers import default_d_ff

FLOP_FORMULA = ("FLOPs/token = 6*N + 12*n_layers*d_model*seq_len  (PaLM app. B / nanoGPT; N = params in matmuls = "
                "all params minus the input-embedding lookup table; attention term without causal discount)")


# ---------------------------------------------------------------------------------------------- models ----
def build_ours(args, vocab: int) -> LanguageModel:
    """mixerzoo's core LM: attention layers, RMSNorm, SwiGLU, RoPE (full rotary, theta 10000)."""
    return LanguageModel(LMConfig(
        vocab_size=vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        layer_types=["attention"], mixers={"attention": {"positional": {"name": "rope", "theta": 10000.0}}},
        channel_mixer="swiglu", d_ff=args.d_ff, norm="rmsnorm", norm_eps=1e-6, tie_embeddings=args.tie,
        init_std=0.02))


def build_llama(args, vocab: int):
    """transformers' LlamaForCausalLM with the same shape; attention through SDPA, no KV cache in training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.d_model, intermediate_size=args.d_ff, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads, max_position_embeddings=args.seq_len,
        hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=args.tie, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, initializer_range=0.02, use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"Llama uses attention {model.config._attn_implementation!r}, expected 'sdpa'")
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once


# ------------------------------------------------------------------------------------------- training -----
def make_step(model, kind: str, lr: float, vocab: int, device: str = "cpu", dtype: str = "fp32"):
    """One optimizer step on ``(x, y)``: zero_grad, forward, mean cross-entropy, backward, AdamW step (fused on
    CUDA), the forward and loss under :func:`autocast`."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    model.train()
    if kind == "llama":
        def loss_fn(x, y):
            return F.cross_entropy(model(input_ids=x, use_cache=False).logits.view(-1, vocab).float(), y.view(-1))
    else:
        def loss_fn(x, y):
            return F.cross_entropy(model(x)[0].view(-1, vocab).float(), y.view(-1))
        if kind == "compiled":
            loss_fn = torch.compile(loss_fn)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step.device = device
    return step


def time_step(step, x, y) -> tuple[float, float]:
    """Wall and process-CPU seconds of one optimizer step (after the device has finished it)."""
    device = getattr(step, "device", "cpu")
    sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    step(x, y)
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def matmul_rate(n: int, threads: int, reps: int = 3, device: str = "cpu", dtype: str = "fp32"
                ) -> tuple[float, float]:
    """Best FLOP/s of an ``n x n @ n x n`` matmul (``2 n^3`` FLOPs; fp32, or bf16 for ``dtype: bf16``) over
    ``reps`` calls, by wall clock and by process CPU time per thread (the rate the threads reach while they are
    on a core; meaningless on a GPU, where the wall-clock rate is the peak)."""
    kind = torch.float32 if dtype == "fp32" else torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=kind), torch.randn(n, n, device=device, dtype=kind)
    torch.mm(a, b)
    wall = cpu = float("inf")
    for _ in range(reps):
        sync(device)
        c0, t0 = time.process_time(), time.perf_counter()
        torch.mm(a, b)
        sync(device)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, (time.process_time() - c0) / threads)
    return 2 * n ** 3 / wall, 2 * n ** 3 / max(cpu, 1e-9)


def check_llama_sdpa_causal(model, x) -> str:
    """Run one Llama forward and report how SDPA was called (is_causal flag / explicit mask)."""
    calls = []
    orig = F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append((kw.get("is_causal"), kw.get("attn_mask") is not None))
        return orig(*a, **kw)

    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(input_ids=x[:, :64], use_cache=False)
    finally:
        F.scaled_dot_product_attention = orig
    return "; ".join(sorted({f"is_causal={c}, explicit mask={m}" for c, m in calls})) or "SDPA not called"


def profile(step, x, y, name: str, rows: int) -> dict[str, tuple[int, float]]:
    """Print torch.profiler's top ops of 2 training steps; return ``{op: (calls, self CPU ms)}``."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    cuda = getattr(step, "device", "cpu") == "cuda"
    step(x, y)
    with tprofile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(2):
            step(x, y)
        sync("cuda" if cuda else "cpu")
    events = prof.key_averages()
    clock = "CUDA" if cuda else "CPU"
    print(f"\n## torch.profiler: {name}, 2 training steps, top {rows} ops by self {clock} time (profiler times are "
          f"wall-clock per op, so inflated when other processes share the cores)")
    print(events.table(sort_by=f"self_{clock.lower()}_time_total", row_limit=rows, max_name_column_width=50))
    return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in events if e.key.startswith("aten::")}


def print_op_diff(a: dict, b: dict, name_a: str, name_b: str) -> None:
    """The aten ops whose call counts differ between two profiles (load-independent structural difference)."""
    rows = [(k, a.get(k, (0, 0.0)), b.get(k, (0, 0.0))) for k in sorted(set(a) | set(b))]
    rows = [r for r in rows if r[1][0] != r[2][0]]
    print(f"\n## aten ops called a different number of times in 2 steps ({name_a} vs {name_b}); self CPU ms")
    for k, (ca, ta), (cb, tb) in rows:
        print(f"  {k:<45} {ca:>5} {cb:>5}   {ta:9.1f} {tb:9.1f}")
    if not rows:
        print("  (none)")


def fmt_rate(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


# ------------------------------------------------------------------------------------------------ main -----
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--n-layers", type=int, default=4, help="blocks")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads (no GQA)")
    p.add_argument("--d-ff", type=int, default=None, help="SwiGLU width; default 8/3*d_model rounded up to 64")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (padded to 64 for both models)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per model per repeat")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per model before each timed repeat")
    p.add_argument("--repeats", type=int, default=9, help="interleaved repeats; the median is reported")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads for the models and the matmul peak (use 1 on a shared machine)")
    p.add_argument("--tie", action="store_true", help="tie input embedding and head (default untied, as Llama)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the square matmul timed as peak")
    p.add_argument("--compile", action="store_true", help="add a torch.compile'd mixerzoo arm")
    p.add_argument("--compile-warmup", type=int, default=2,
                   help="untimed steps that compile (bounded; the arm is timed after these)")
    p.add_argument("--compile-warm-cache", action="store_true",
                   help="reuse inductor's on-disk cache (default: a fresh one, so the compile time is a cold one)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler top ops of each eager model")
    p.add_argument("--profile-rows", type=int, default=18, help="ops per profiler table")
    p.add_argument("--seed", type=int, default=0, help="seed of the init and the token batch")
    add_device_args(p)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak for MFU (e.g. 989 for an H100 SXM's dense bf16); default: the measured matmul rate")
    args = p.parse_args(argv)
    args.d_ff = args.d_ff or default_d_ff("swiglu", args.d_model)
    check_device(p, args.device)

    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from mixerzoo.evaluation.stamp import command_line, stamp, stamp_lines

    given = sys.argv[2:] if argv is None else argv
    print(stamp_lines(stamp(command_line(["benchmarks/run.py", "throughput", *given]), args.device), "# "))
    print(f"# run.py throughput: mixerzoo attention LM vs transformers LlamaForCausalLM, training, "
          f"{args.device} {args.dtype}; transformers {transformers.__version__}")

    ours = build_ours(args, args.vocab).to(args.device)
    vocab = ours.config.padded_vocab_size
    llama = build_llama(args, vocab).to(args.device)
    n_ours, n_llama = count_params(ours), count_params(llama)
    f_ours, f_llama = flop_parameters(ours), flop_parameters(llama)
    print(f"# shape: d_model {args.d_model}, n_layers {args.n_layers}, n_heads {args.n_heads}, d_ff {args.d_ff} "
          f"(SwiGLU), vocab {vocab}, {'tied' if args.tie else 'untied'} head, RMSNorm eps 1e-6, RoPE theta 1e4")
    print(f"# parameters: mixerzoo {n_ours:,}  llama {n_llama:,}  (N for FLOPs: {f_ours:,} / {f_llama:,})")
    if n_ours != n_llama or f_ours != f_llama:
        raise SystemExit("parameter counts differ: the comparison would not be like for like")
    tokens = args.batch * args.seq_len
    flops_token = training_flops_per_token(ours, args.seq_len)  # the count `mixerzoo fit` logs MFU with
    assert flops_token == 6 * f_ours + 12 * args.n_layers * args.d_model * args.seq_len, "FLOP count changed"
    print(f"# {FLOP_FORMULA}")
    print(f"#   = 6*{f_ours:,} + 12*{args.n_layers}*{args.d_model}*{args.seq_len} = {flops_token / 1e6:.2f} MFLOP "
          f"per token; {tokens} tokens (batch {args.batch} x seq_len {args.seq_len}) per optimizer step (AdamW)")

    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    x, y = data[:, :-1].contiguous().to(args.device), data[:, 1:].contiguous().to(args.device)
    print(f"# Llama SDPA: {check_llama_sdpa_causal(llama, x)}")

    on = (args.device, args.dtype)
    arms = {"mixerzoo": make_step(ours, "ours", args.lr, vocab, *on),
            "llama": make_step(llama, "llama", args.lr, vocab, *on)}
    labels = {"mixerzoo": "mixerzoo attention (eager)", "llama": "HF LlamaForCausalLM sdpa",
              "compiled": "mixerzoo + torch.compile"}
    for name, step in arms.items():  # first-touch warmup, untimed
        step(x, y)

    if args.compile:
        if not args.compile_warm_cache:  # time a cold compile, not one served from an earlier run's cache
            cache = tempfile.mkdtemp(prefix="bench_inductor_")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            atexit.register(shutil.rmtree, cache, True)
        compiled_model = copy.deepcopy(ours)
        step = make_step(compiled_model, "compiled", args.lr, vocab, *on)
        print(f"# torch.compile (inductor, default mode) of mixerzoo forward + loss (backward via AOTAutograd), "
              f"{'warm' if args.compile_warm_cache else 'cold'} cache; {args.compile_warmup} untimed warmup steps:",
              flush=True)
        try:
            for i in range(args.compile_warmup):
                wall, cpu_s = time_step(step, x, y)
                print(f"#   compile warmup step {i}: wall {wall:.1f} s (this process's CPU {cpu_s:.1f} s; compile "
                      f"workers not counted)", flush=True)
            arms["compiled"] = step
        except Exception as e:  # report honestly and go on without the arm
            print(f"#   torch.compile FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")

    if args.profile:
        prof = {name: profile(arms[name], x, y, labels[name], args.profile_rows) for name in ("mixerzoo", "llama")}
        print_op_diff(prof["mixerzoo"], prof["llama"], "mixerzoo", "llama")

    names = list(arms)
    wall_rate = {n: [] for n in names}  # tokens / wall second, per repeat
    cpu_rate = {n: [] for n in names}  # tokens / (process CPU second / threads), per repeat
    share = {n: [] for n in names}
    peaks = []
    print(f"\n## raw repeats: {args.steps} timed steps per model per repeat (after {args.warmup} untimed), order "
          f"alternating; tokens/s by wall clock, then by CPU time (tokens / (process CPU s / threads)), then the "
          f"share of its threads' cores the process got (CPU s / (wall s * threads))")
    for r in range(args.repeats):
        peaks.append(matmul_rate(args.matmul_n, args.threads, device=args.device, dtype=args.dtype))
        order = names if r % 2 == 0 else names[::-1]
        line = [f"repeat {r}: matmul {peaks[-1][0] / 1e9:5.1f} / {peaks[-1][1] / 1e9:5.1f} GFLOP/s"]
        for n in order:
            for _ in range(args.warmup):
                arms[n](x, y)
            walls, cpus = zip(*(time_step(arms[n], x, y) for _ in range(args.steps)))
            wall_rate[n].append(args.steps * tokens / sum(walls))
            cpu_rate[n].append(args.steps * tokens / (sum(cpus) / args.threads))
            share[n].append(sum(cpus) / (sum(walls) * args.threads))
            line.append(f"{n} {wall_rate[n][-1]:6.0f} / {cpu_rate[n][-1]:6.0f} ({share[n][-1]:.0%})")
        print("  " + " | ".join(line), flush=True)
    peaks.append(matmul_rate(args.matmul_n, args.threads, device=args.device, dtype=args.dtype))
    if args.peak_tflops:
        peaks = [(args.peak_tflops * 1e12, args.peak_tflops * 1e12)]

    peak_wall, peak_cpu = max(p[0] for p in peaks), max(p[1] for p in peaks)
    print(f"\n## results: median over {args.repeats} interleaved repeats [min-max]")
    if args.peak_tflops:
        print(f"peak = --peak-tflops {args.peak_tflops:g} (given, not measured)")
    else:
        print(f"peak = best {args.dtype} {args.matmul_n}x{args.matmul_n} matmul on {args.device}, {args.threads} "
              f"thread(s), {len(peaks)} probes in this run: {peak_wall / 1e9:.1f} GFLOP/s by wall clock, "
              f"{peak_cpu / 1e9:.1f} GFLOP/s by CPU time")
    print("MFU = tokens/s * FLOPs/token / peak, each on the same clock (wall: what a user waits; CPU: robust to "
          "other processes sharing the cores)")
    head = (f"{'model':<27} {'params':>10} {'tok/s wall [min-max]':>21} {'MFU wall':>8} "
            f"{'tok/s CPU [min-max]':>21} {'ms/step CPU':>11} {'MFU CPU':>7}")
    print(head)
    print("-" * len(head))
    for n in names:
        mw, mc = statistics.median(wall_rate[n]), statistics.median(cpu_rate[n])
        print(f"{labels[n]:<27} {n_ours:>10,} {fmt_rate(wall_rate[n]):>21} {mw * flops_token / peak_wall:>8.1%} "
              f"{fmt_rate(cpu_rate[n]):>21} {tokens / mc * 1e3:>11.0f} {mc * flops_token / peak_cpu:>7.1%}")
    print()

    def ratio(a: str, b: str, target: str = "") -> None:
        for clock, rates in (("wall", wall_rate), ("CPU ", cpu_rate)):
            per = [u / v for u, v in zip(rates[a], rates[b])]
            print(f"ratio {a} / {b} tokens/s ({clock}): median {statistics.median(per):.3f}x  "
                  f"(per repeat {', '.join(f'{v:.3f}' for v in per)}){target}")

    ratio("mixerzoo", "llama", "; target >= 1.0x")
    if "compiled" in names:
        ratio("compiled", "mixerzoo")
        ratio("compiled", "llama")
    print(f"# load avg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
