"""Every bundled plugin's Triton kernels (and the core's RoPE kernel) compile for an H100 (sm_90) at the GPU
benchmark's sizes and fit its shared memory, checked without a GPU: Triton compiles to a cubin with its bundled
ptxas on any machine. What this does not check (a GPU run does: ``benchmarks/gpu_suite.py``'s kernels step): that
the compiled kernels compute the right values, and how fast. Runs in a subprocess, because a plugin's kernels are
defined once per process, and on a machine without a GPU :mod:`mixerzoo.kernels` defines them for Triton's
interpreter."""

import json
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

H100_SHARED = 232_448  # bytes of shared memory one block may use on sm_90 (227 KiB)

SCRIPT = textwrap.dedent('''
    import json
    import mixerzoo.kernels as kernels
    kernels.interpreted = lambda: False  # before any plugin defines its kernels: triton.jit, not the interpreter
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mixerzoo_kvm.backends.triton import route_kernel
    from mixerzoo_ovq.backends.triton import decide
    from mixerzoo_trellis.backends.triton import scan

    def compile_(fn, signature, constexprs, num_warps):
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).metadata.shared

    out = {}
    p = "*fp32"
    out["kvm route_folds C=256 D=128"] = compile_(
        route_kernel.route_folds_kernel,
        {"s_k_ptr": p, "kb_ptr": p, "g_ptr": p, "sizes_ptr": "*i32", "w_ptr": p, "b_ptr": p, "target_ptr": "*i64",
         "appended_ptr": "*i8", "n_folds": "i32", "R": "i32", "C": "i32", "D": "i32", "ln_eps": "fp32",
         "n_protected": "i32"},
        {"HAS_GATE": True, "GATE_APPENDS": False, "BLOCK_C": 256, "BLOCK_D": 128, "BLOCK_R": 32}, 4)
    out["ovq decide L=128 D=128"] = compile_(
        decide._decide_kernel,
        {"k_ptr": p, "dk_ptr": p, "cnt_ptr": p, "nnew_ptr": "*i32", "scores_ptr": p, "assign_ptr": "*i32",
         "reset_ptr": "*i32", "n0": "i32", "C": "i32", "N_TOT": "i32"},
        {"L": 128, "D": 128, "BL": 128, "BD": 128, "BN": decide.BLOCK_N, "HAS_SCORES": False, "HAS_RESETS": True}, 8)
    for name, fn, ptrs in (("fwd", scan._scan_fwd, ["W", "A", "DEC", "STEP", "MS", "MG", "U", "M0", "MEND"]),
                           ("bwd", scan._scan_bwd, ["W", "A", "DEC", "STEP", "M0", "MG", "DU", "DM0", "DMEND", "DW",
                                                    "DA", "DDEC", "DSTEP", "DMS", "DMG"])):
        consts = {"BC": 16, "BM": 64, "BD": 128, "SILU": True, **({"DETACH": False} if name == "bwd" else {})}
        signature = {**{n: p for n in ptrs}, **{n: "i32" for n in "NCMD"}}
        out[f"trellis scan {name} C=16 m=64 d=128"] = compile_(fn, signature, consts, 8)
    from mixerzoo_kvm.backends.triton import decode_kernel as kvm_decode
    out["kvm decode_fold C=256 D=128"] = compile_(
        kvm_decode.decode_fold_kernel,
        {**{n: p for n in ("s_k_ptr", "s_v_ptr", "rho_ptr", "cnt_ptr", "k_ptr", "v_ptr", "g_ptr")},
         **{n: "i32" for n in ("k_sb", "k_sh", "k_sc", "k_sd", "v_sb", "v_sh", "v_sc", "v_sd", "g_sb", "g_sh", "g_sc")},
         "w_ptr": p, "b_ptr": p, "kb_ptr": p, "tgt_ptr": "*i64", "app_ptr": "*i8", "out_k_ptr": p, "out_v_ptr": p,
         "out_rho_ptr": p, "out_cnt_ptr": p, **{n: "i32" for n in ("H", "m", "m_new", "C", "D", "rotary_dim")},
         "ln_eps": "fp32", "n_protected": "i32"},
        {"HAS_GATE": True, "GATE_APPENDS": False, "HAS_COUNT": False, "BLOCK_C": 256, "BLOCK_D": 128, "BLOCK_R": 32}, 8)
    from mixerzoo_ovq.backends.triton import decode as ovq_decode
    out["ovq decode read D=128"] = compile_(
        ovq_decode._read_kernel,
        {**{n: p for n in ("q_ptr", "dk_ptr", "dv_ptr", "lc_ptr", "kc_ptr", "vc_ptr", "o_ptr")},
         **{n: "i32" for n in ("n", "Lk", "G")}},
        {"D": 128, "BG": 16, "BD": 128, "BN": decide.BLOCK_N}, 4)
    out["ovq decode merge L=128 D=128"] = compile_(
        ovq_decode._merge_kernel,
        {**{n: p for n in ("kc_ptr", "vc_ptr", "dk_ptr", "dv_ptr", "cnt_ptr", "scores_ptr", "dk_out", "dv_out",
                           "cnt_out", "lc_out")}, "n": "i32", "n_new": "i32"},
        {"L": 128, "D": 128, "BL": 128, "BD": 128, "BN": decide.BLOCK_N, "HAS_SCORES": False}, 8)
    from mixerzoo_trellis.backends.triton import decode as trellis_decode
    out["trellis decode_step m=64 d=128"] = compile_(
        trellis_decode._decode_kernel,
        {**{n: p for n in ("Q", "K", "V", "A", "GATE", "GAMMA", "CW", "CACHE", "MK", "MKG", "MV", "MVG", "Y",
                           "MK_OUT", "MV_OUT", "CACHE_OUT")},
         **{n: "i32" for n in ("H", "M", "DK", "DV", "KS", "S_MK_B", "S_MK_H", "S_MKG_B", "S_MKG_H", "S_MV_B",
                               "S_MV_H", "S_MVG_B", "S_MVG_H")}},
        {"BM": 64, "BDK": 128, "BDV": 128, "BK": 4, "SILU": True, "ACT": 0, "HAS_GATE": True, "GATE_LOGITS": True,
         "GAMMA_RAW": True, "WRITE_NORM": True, "CONV": True, "HAS_CACHE": True}, 8)
    from mixerzoo import positional
    for dt in ("fp32", "bf16"):
        out[f"rope {dt} r=64 d=128"] = compile_(
            positional._rope_kernel(),
            {"x_ptr": "*" + dt, "out_ptr": "*" + dt, "pos_ptr": "*i64", "inv_freq_ptr": p,
             **{n: "i32" for n in ("T", "D", "sx0", "sx1", "sx2", "so0", "so1", "so2", "n1")}, "sign": "fp32"},
            {"HALF": 32, "BLOCK": 32, "TAIL": 64, "ADJACENT": dt == "bf16", "TABLE": None, "TABLE_BF16": dt == "bf16"},
            4)
    print(json.dumps(out))
''')


def test_kernels_compile_for_h100_within_its_shared_memory():
    if "nvidia" not in __import__("triton.backends", fromlist=["backends"]).backends:
        pytest.skip("this Triton has no CUDA backend")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 10
    too_big = {k: v for k, v in shared.items() if v > H100_SHARED}
    assert not too_big, f"shared memory over an H100's {H100_SHARED} bytes per block: {too_big}"
