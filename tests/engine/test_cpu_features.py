"""The kernels' instruction set follows the CPU the process compiles for, and every set gives the same numbers.

Selection is a pure function of a feature set (engine.runtime.kernel_isa, then simd.kernel_set), tested for
each set. Each instruction set this host can run is then compiled in a subprocess for a CPU that has only its
features (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: a lesser CPU emulated), where every format's group kernels run,
and compared bit for bit with the host's own, which its process checks against gguf's dequantize, the plain-loop
reference and the parallel drivers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import runtime
from engine.errors import SettingsError
from engine.formats import QUANTIZED
from engine.formats.emit import MADDUBS_BYTE_MAX, QUADS
from engine.kernels import simd
from engine.runtime import AVX2, AVX512_BW, AVX512_VNNI, AVX_VNNI, PORTABLE, kernel_isa

REPO = Path(__file__).resolve().parents[2]

ZEN3 = {"sse2", "ssse3", "sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "bmi2"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ALDER_LAKE = ZEN3 | {"avxvnni"}
ZEN4 = SKYLAKE_X | {"avx512vnni", "avx512bf16", "avxvnni"}
CASCADE_LAKE = SKYLAKE_X | {"avx512vnni"}


@pytest.mark.parametrize(
    ("features", "isa"),
    [
        (set(), PORTABLE),
        ({"sse2", "sse4.2", "avx", "f16c"}, PORTABLE),  # Sandy/Ivy Bridge: AVX without AVX2
        (ZEN3, AVX2),
        (ALDER_LAKE, AVX_VNNI),
        (SKYLAKE_X, AVX512_BW),
        (CASCADE_LAKE, AVX512_VNNI),
        (ZEN4, AVX512_VNNI),
        (ZEN3 | {"avx512f"}, AVX2),  # AVX-512 without BW has no 512-bit byte products
        (ZEN3 | {"avx512f", "avx512vnni"}, AVX2),
        ({"avxvnni"}, PORTABLE),  # VNNI is of no use without the AVX2 integer vectors
    ],
)
def test_instruction_set_for_each_feature_set(features: set[str], isa: str) -> None:
    assert kernel_isa(features) == isa


def test_each_kernel_set_lays_each_format_out_for_its_instructions() -> None:
    codes = {f.code for f in QUANTIZED.values()}
    # vpdpbusd takes any byte; pmaddubsw sums two products in 16 bits, so only small weight bytes go in quads
    small = {f.code for f in QUANTIZED.values() if QUADS in f.emitters and f.quad_byte_max <= MADDUBS_BYTE_MAX}
    assert {T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q4_0} <= {T(c) for c in small}
    assert {T.Q8_0, T.IQ4_XS, T.IQ4_NL} <= {T(c) for c in simd.QUAD_CODES - small}
    expect = {  # isa: formats in quads, (L, W) of the pair formats, of the quad formats
        AVX512_VNNI: (simd.QUAD_CODES, (32, 2), (16, 4)),
        AVX_VNNI: (simd.QUAD_CODES, (16, 2), (8, 4)),
        AVX512_BW: (small, (32, 2), (16, 4)),
        AVX2: (small, (16, 2), (8, 4)),
        PORTABLE: (set(), (16, 2), (16, 2)),
    }
    for isa, (quads, pair_layout, quad_layout) in expect.items():
        ks = simd.kernel_set(isa)
        pair, quad = sorted(codes - quads), sorted(quads)
        assert [ks.layout(c) for c in pair] == [pair_layout] * len(pair), isa
        assert [ks.layout(c) for c in quad] == [quad_layout] * len(quad), isa
        for c in codes:  # a register holds L rows of W bytes; the 64-row group is whole chunks
            lanes, width = ks.layout(c)
            assert lanes * width == ks.vector_bytes and simd.ROWS % lanes == 0
    with pytest.raises(ValueError, match="sse9"):
        simd.kernel_set("sse9")


def test_the_host_kernels_follow_the_compile_target() -> None:
    """What runtime finds before Numba loads (the cache folder's key, the kernel set) is what Numba compiles for:
    its code generator's own view (private attributes, read here only as the oracle)."""
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    numba_features = frozenset(f[1:] for f in codegen._tm_features.split(",") if f.startswith("+"))
    name, features = runtime.compile_target(os.environ)
    assert (name, features) == (codegen._get_host_cpu_name(), numba_features)
    assert (name, features) == (simd.TARGET_NAME, simd.TARGET_FEATURES)
    assert simd.KERNELS.isa == runtime.chosen_isa(os.environ, features)
    assert simd.KERNELS.f16c == ("f16c" in features)
    assert runtime.KERNEL_CACHE_DIR.name.startswith(simd.KERNELS.isa + "-")


def test_host_flags_reach_the_kernel_set() -> None:
    """Against the kernel's own view of the CPU (/proc/cpuinfo), unless the target was overridden."""
    if any(os.environ.get(v) for v in _OVERRIDES):
        pytest.skip("the compile target or the kernel set is overridden")
    flags = _proc_flags()
    linux = {"avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}
    host = {llvm for llvm, proc in linux.items() if proc in flags} | ({"avx2"} & flags)
    assert simd.KERNELS.isa == kernel_isa(host)


def test_a_named_kernel_set_is_used_where_the_cpu_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    every = [AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2, PORTABLE]
    assert runtime.runnable_isas(CASCADE_LAKE) == every  # 256-bit vpdpbusd as EVEX: VNNI with VL
    assert runtime.runnable_isas(ALDER_LAKE) == [AVX_VNNI, AVX2, PORTABLE]
    assert runtime.runnable_isas(SKYLAKE_X) == [AVX512_BW, AVX2, PORTABLE]
    assert runtime.runnable_isas(ZEN3) == [AVX2, PORTABLE]
    var = runtime.KERNEL_SET_VARIABLE
    assert runtime.chosen_isa({}, CASCADE_LAKE) == AVX512_VNNI
    assert runtime.chosen_isa({var: AVX_VNNI}, CASCADE_LAKE) == AVX_VNNI
    with pytest.raises(SettingsError, match="this CPU runs the kernel sets avx2, portable"):
        runtime.chosen_isa({var: AVX512_VNNI}, ZEN3)
    best = runtime._kernel_cache_dir()
    monkeypatch.setenv(var, PORTABLE)
    named = runtime._kernel_cache_dir()
    assert named.name.startswith("portable-") and named != best  # never the best set's kernels


def test_the_cache_folder_is_keyed_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", _features_string(ZEN3))
    avx2 = runtime._kernel_cache_dir()
    monkeypatch.setenv("NUMBA_CPU_FEATURES", _features_string(ALDER_LAKE))
    vnni = runtime._kernel_cache_dir()
    monkeypatch.setenv("NUMBA_CPU_NAME", "alderlake")
    other_cpu = runtime._kernel_cache_dir()
    assert avx2.name.startswith("avx2-") and vnni.name.startswith("avxvnni-")
    assert len({avx2, vnni, other_cpu}) == 3
    assert avx2.parent == vnni.parent == runtime.KERNEL_CACHE_DIR.parent


def _proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def _features_string(features: set[str]) -> str:
    return ",".join(f"+{f}" for f in sorted(features))


# ---- every instruction set the host can run, against the reference and against each other ---------------

_DROP = {  # the host's features to turn off to leave a CPU with this instruction set at best
    AVX_VNNI: ("avx512",),
    AVX512_BW: ("avx512vnni", "avxvnni", "avx10", "amx"),
    AVX2: ("avx512", "avxvnni", "avx10", "amx"),
}


_OVERRIDES = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", runtime.KERNEL_SET_VARIABLE)


def _emulated_env(isa: str) -> dict[str, str] | None:
    """Environment for a subprocess compiling for a CPU whose best kernel set is `isa`, or None if this host
    cannot run it. Where no lesser CPU's features leave `isa` the best but the host runs it (the `avxvnni` set on
    a Zen 4: AVX-512 VNNI without AVX-VNNI), the host's own target with CHATAPP_KERNEL_SET naming it."""
    env = {k: v for k, v in os.environ.items() if k not in _OVERRIDES}
    name, host = runtime.compile_target(env)
    if isa == PORTABLE:  # the x86-64 baseline: SSE2, no F16C
        return {**env, "NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": ""} if "sse2" in host else None
    kept = {f for f in host if not f.startswith(_DROP.get(isa, ()))}
    if kernel_isa(kept) != isa:
        return {**env, runtime.KERNEL_SET_VARIABLE: isa} if isa in runtime.runnable_isas(host) else None
    off = ",".join(f"-{f}" for f in sorted(host - kept))
    return {**env, "NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": ",".join(filter(None, [_features_string(kept), off]))}


def group_products(w, xs: np.ndarray, tiles: bool) -> np.ndarray:
    """xs (t, cols) @ W.T -> (t, rows) through the format's group kernels alone, without the parallel drivers:
    every token by group_simd (`tiles` False), or as packed.matmul runs a pass (`tiles`: TILE tokens at a time
    by group_simd_tile and the rest of each 16 one by one; under TILE tokens, padded to one tile)."""
    from engine.kernels import packed

    p = w.packed
    t, rows = xs.shape[0], w.rows
    xq, dx, xsum, xq2 = packed.row_buffers(t, xs.shape[1], paired=bool(packed.PAIRED[p.code]))
    packed.quantize_rows(xs, xq, dx, xsum, xq2, False)
    out = np.empty((t, p.q.shape[0] * packed.ROWS), dtype=np.float32)
    acc = np.empty((packed.TILE, packed.ROWS), dtype=np.float32)
    for g in range(p.q.shape[0]):
        cols = slice(g * packed.ROWS, (g + 1) * packed.ROWS)
        for t0 in range(0, t, packed.PER_ITEM):
            i, t1 = t0, min(t, t0 + packed.PER_ITEM)
            while i < t1:
                if tiles and (t1 - i >= packed.TILE or xq.shape[0] > t):
                    packed.group_simd_tile(p.q, p.s, p.fmt, g, xq, xq2, dx, xsum, i, acc)
                    done = min(packed.TILE, t1 - i)
                else:
                    packed.group_simd(p.q, p.s, p.fmt, g, xq[i], dx[i], xsum[i], acc[0])
                    done = 1
                out[i : i + done, cols] = acc[:done]
                i += done
    return out[:, :rows]


def check_every_format(out_path: str, against_reference: bool = True) -> None:
    """In this process's kernel set: every packed format's decode and prefill products, the outputs saved to
    out_path for comparison across sets; with `against_reference`, also against gguf's dequantize (through
    W @ x̂) and the plain loops, and through the parallel drivers (packed.matmul, matvec). A set whose outputs
    are then compared bit for bit with a set that was checked against the reference needs no check of its own:
    the plain loops are compiled kernels too. Nor does it run the drivers, which are the same code in every set
    and only copy the group kernels' sums out: compiling their parallel loops for each format would take a
    third of an emulated set's time."""
    from engine.kernels import PACKED_TYPES, WeightMatrix, matvec, packed
    from tests.engine.test_kernels import check_int8_matvec, oracle, random_blocks

    results = {"isa": np.array(simd.KERNELS.isa)}
    for qtype in sorted(PACKED_TYPES):
        results[f"{qtype.name} at the bound"] = check_at_the_bound(qtype, against_reference)
        rng = np.random.default_rng(int(qtype) + 900)
        rows, cols = 130, 512  # a zero-padded last group
        raw = random_blocks(qtype, rows, cols, rng)
        w = WeightMatrix.from_raw("isa", qtype, rows, cols, raw).prepare()
        # the same tokens in every set (compared across sets): 18 = two tiles of 8 and two more (AVX-512's
        # tile), or four tiles of 4 and two more (AVX2's)
        xs = rng.standard_normal((18, cols)).astype(np.float32)
        p = w.packed
        assert p.q.shape[4:] == packed.layout(p.code), qtype.name
        one = group_products(w, xs, tiles=False)
        # whole tiles and two more; then three tokens, padded to one tile
        np.testing.assert_array_equal(group_products(w, xs, tiles=True), one, err_msg=qtype.name)
        np.testing.assert_array_equal(group_products(w, xs[:3], tiles=True), one[:3], err_msg=qtype.name)
        if against_reference:
            drivers = np.empty((len(xs), rows), dtype=np.float32)
            packed.matmul(p.q, p.s, p.fmt, xs, drivers, *packed.row_buffers(*xs.shape), False)
            np.testing.assert_array_equal(drivers, one, err_msg=qtype.name)
            short = np.empty((3, rows), dtype=np.float32)
            packed.matmul(p.q, p.s, p.fmt, xs[:3], short, *packed.row_buffers(3, cols), False)
            np.testing.assert_array_equal(short, one[:3], err_msg=qtype.name)
            np.testing.assert_array_equal(np.stack([matvec(w, x) for x in xs]), one, err_msg=qtype.name)
            ref = oracle(qtype, raw, rows, cols)
            for i, x in enumerate(xs):
                check_int8_matvec(w, ref, x, one[i])
            loops = np.empty(rows, dtype=np.float32)
            packed.matvec_reference(p.q, p.s, p.fmt, xs[0], loops)
            assert np.abs(one[0] - loops).max() <= 1e-6 * np.abs(loops).max(), qtype.name
        results[qtype.name] = one
    # Within this set only: other vector widths sum attention in another order. Not on the x86-64 baseline: without
    # F16C, LLVM lowers the kernels' float16 conversions to __extendhfsf2, which Numba's JIT does not link
    # ("Symbol not found"), so attention does not compile there at all.
    if simd.KERNELS.f16c:
        check_attention_rows()
    np.savez(out_path, **results)


def check_at_the_bound(qtype: T, against_reference: bool) -> np.ndarray:
    """Every weight byte 0xFF but the scale fields (each format's largest values: nibbles 15, Q5_K's 31, Q6_K's
    63, Q3_K's 7) against activations of +127 and -127 in every place, where the pmaddubsw kernels' 16-bit sums
    reach their bound: the tile and one-token kernels agree, and (`against_reference`) equal W @ x̂. Returns
    the one-token outputs (18, 64)."""
    from gguf import GGML_QUANT_SIZES

    from engine.kernels import WeightMatrix, matvec
    from tests.engine.test_kernels import E8M0_FIELDS, HALF_FIELDS, check_int8_matvec, oracle, random_blocks

    rows, cols = 64, 512
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(0)).reshape(-1, block_bytes)
    values = np.ones(block_bytes, dtype=bool)
    for off in HALF_FIELDS.get(qtype, []):
        values[off : off + 2] = False
    for off in E8M0_FIELDS.get(qtype, []):
        values[off] = False
    raw[:, values] = 0xFF
    raw = raw.reshape(rows, -1)
    w = WeightMatrix.from_raw("bound", qtype, rows, cols, raw).prepare()
    xs = np.repeat(np.array([[1.0], [-1.0]], dtype=np.float32), 9, axis=0) * np.ones(cols, dtype=np.float32)
    one = group_products(w, xs, tiles=False)
    np.testing.assert_array_equal(group_products(w, xs, tiles=True), one, err_msg=f"{qtype.name} at the bound")
    if against_reference:
        np.testing.assert_array_equal(np.stack([matvec(w, x) for x in xs]), one, err_msg=f"{qtype.name} bound")
        ref = oracle(qtype, raw, rows, cols)
        for i in (0, len(xs) - 1):
            check_int8_matvec(w, ref, xs[i], one[i])
    return one


def check_attention_rows() -> None:
    """In this process's kernel set: a pass's queries attended one row at a time (the prompt path with
    --deterministic) give each row what the one-token kernel gives it alone, bit for bit, on 1 and 2 threads."""
    from engine.kernels import attention

    rng = np.random.default_rng(48)
    n_head, n_kv, hd, t, start = 6, 2, 64, 40, 400  # from position 400: 2 threads split the one-token kernel
    kc = rng.standard_normal((n_kv, start + t, hd)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((n_kv, start + t, hd)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((t, n_head * hd)).astype(np.float32)
    rows = np.empty_like(q)
    attention.attend_rows(q, kc, vc, start, n_head, 0.125, 0, 0.0, rows)
    for threads in (1, 2):
        for i in range(t):
            one = np.empty(n_head * hd, dtype=np.float32)
            attention.attend_one(q[i], kc, vc, start + i, n_head, 0.125, 0, 0.0, threads, one)
            np.testing.assert_array_equal(rows[i], one, err_msg=f"{simd.KERNELS.isa}: row {i}, {threads} threads")


def _run_checks(env: dict[str, str], out: Path, against_reference: bool) -> dict[str, np.ndarray]:
    code = (
        "from tests.engine.test_cpu_features import check_every_format; "
        f"check_every_format({str(out)!r}, {against_reference})"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


# Every kernel set, and the sets this host can run: those run every format against the host's (below). Every
# set but the portable one is also compiled for a CPU that has it, whether or not this one does, and its machine
# code checked (`test_each_instruction_set_compiles_to_its_instructions`): a CPU without AVX-512 cannot run the
# AVX-512 sets, and the end of the test run names the sets it compiled but did not run (tests/conftest.py).
KERNEL_SETS = (AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2, PORTABLE)
RUNNABLE = [isa for isa in KERNEL_SETS if _emulated_env(isa) is not None]
NOT_RUN = [isa for isa in KERNEL_SETS if isa not in RUNNABLE]
HOST = "host"


def _kernels_target(env: dict[str, str]) -> tuple:
    """What a process in `env` compiles its block kernels for: the CPU target and the kernel set."""
    name, features = runtime.compile_target(env)
    return name, features, runtime.chosen_isa(env, features)


@pytest.fixture(scope="module")
def isa_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    """Every runnable set's outputs, and the host's own, keyed by set. Each process compiles every format's
    kernels for its set (minutes on one core): they run side by side, one per core. The host's process is
    checked against the reference, the others against the host, bit for bit; the set the host itself runs
    (the same compile target as the host's) is the host's run, not a second compile of the same kernels."""
    folder = tmp_path_factory.mktemp("isa")
    host_env = {k: v for k, v in os.environ.items() if k not in _OVERRIDES}
    host_target = _kernels_target(host_env)
    envs: dict[str, dict[str, str]] = {HOST: host_env}
    same_as_host = []
    for isa in RUNNABLE:
        env = _emulated_env(isa)
        assert env is not None
        if _kernels_target(env) == host_target:
            same_as_host.append(isa)
        else:
            envs[isa] = env
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {isa: pool.submit(_run_checks, env, folder / f"{isa}.npz", isa == HOST) for isa, env in envs.items()}
        results = {isa: run.result() for isa, run in runs.items()}
    return results | {isa: results[HOST] for isa in same_as_host}


@pytest.mark.slow
@pytest.mark.parametrize("isa", RUNNABLE)
def test_each_instruction_set_matches_the_reference_and_the_host(isa: str, request: pytest.FixtureRequest) -> None:
    isa_results: dict[str, dict[str, np.ndarray]] = request.getfixturevalue("isa_results")
    got = dict(isa_results[isa])
    assert str(got.pop("isa")) == isa
    host = dict(isa_results[HOST])
    host_isa = str(host.pop("isa"))
    assert got.keys() == host.keys()
    for name, values in host.items():  # the same integer sums and float operations: bit for bit
        np.testing.assert_array_equal(got[name], values, err_msg=f"{isa} against {host_isa}: {name}")


# A CPU that has each set (LLVM's name and features), to compile for where this one may lack it
SET_CPUS = {
    AVX512_VNNI: ("znver4", ZEN4),
    AVX_VNNI: ("alderlake", ALDER_LAKE),
    AVX512_BW: ("skylake-avx512", SKYLAKE_X),
    AVX2: ("haswell", ZEN3),
}


def kernel_machine_code(out_path: str) -> None:
    """Compile (never run) every format's one-token and tile kernels in this process's kernel set, and save
    their machine code, as Numba's inspect_asm prints it, to out_path (JSON: the set, and per format the two)."""
    import json

    code: dict[str, object] = {"isa": simd.KERNELS.isa}
    for qtype, fmt in sorted(QUANTIZED.items(), key=lambda kv: int(kv[0])):
        code[qtype.name] = _format_machine_code(fmt)
    Path(out_path).write_text(json.dumps(code))


def _format_machine_code(fmt) -> list[str]:
    """[one-token kernel's, tile kernel's] machine code of one format in this process's kernel set."""
    from numba import njit, typeof

    one, tile = simd._one(fmt, simd.KERNELS), simd._tile(fmt, simd.KERNELS)

    @njit
    def one_call(q, s, xq, dx, xsum, acc):
        one(q, 0, s, 0, xq, 0, dx, xsum, 0, acc)

    @njit
    def tile_call(q, s, xq, xq2, n, dx, xsum, nb, acc):
        tile(q, 0, s, 0, xq, xq2, 0, n, dx, xsum, 0, nb, acc)

    dtypes = (np.uint8, np.uint16, np.int8, np.int8, np.float32, np.int32, np.float32)  # flat arrays, as the kernels
    q, s, xq, xq2, dx, xsum, acc = (typeof(np.zeros(1, t)) for t in dtypes)  # take them (q, s, x̂, ..., sums)
    i64 = typeof(1)
    one_call.compile((q, s, xq, dx, xsum, acc))
    tile_call.compile((q, s, xq, xq2, i64, dx, xsum, i64, acc))
    return [f.inspect_asm(f.signatures[0]) for f in (one_call, tile_call)]


def _instructions(asm: str, name: str, register: str) -> int:
    """How many `name` instructions in the machine code have a `register` (ymm, zmm) operand."""
    # the mnemonic is a line's first word, or its second after a "{vex}" encoding prefix (AVX-VNNI)
    return sum(1 for line in asm.splitlines() if name in line.split()[:2] and f"%{register}" in line)


def _compile_for(isa: str, folder: Path) -> dict:
    """kernel_machine_code in a subprocess compiling for SET_CPUS[isa] (its kernels in a cache folder of its own)."""
    import json

    name, features = SET_CPUS[isa]
    env = {k: v for k, v in os.environ.items() if k not in _OVERRIDES}
    env |= {"NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": _features_string(features)}
    env["CHATAPP_CACHE_DIR"] = str(folder / f"{isa}-cache")  # nothing of another CPU's in the user's kernel cache
    out = folder / f"{isa}.json"
    script = f"from tests.engine.test_cpu_features import kernel_machine_code; kernel_machine_code({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def machine_code(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every SIMD set's kernels compiled for a CPU that has it, one process per core."""
    folder = tmp_path_factory.mktemp("machine-code")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {isa: pool.submit(_compile_for, isa, folder) for isa in SET_CPUS}
        return {isa: run.result() for isa, run in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(SET_CPUS))
def test_each_instruction_set_compiles_to_its_instructions(isa: str, machine_code: dict[str, dict]) -> None:
    """Every format's kernels, compiled for a CPU that has the set (in a subprocess; nothing runs there, so a CPU
    without the set checks it too): they multiply with the set's instruction on its registers (vpdpbusd for the
    formats the VNNI sets pack in quads, else vpmaddubsw, or vpmaddwd on widened bytes; zmm for the 512-bit sets,
    ymm for the others) and the 256-bit sets touch no zmm register."""
    code = dict(machine_code[isa])
    assert code.pop("isa") == isa
    kernels = simd.kernel_set(isa)
    register = "zmm" if kernels.vector_bytes == 64 else "ymm"
    vnni = isa in (AVX512_VNNI, AVX_VNNI)
    assert code.keys() == {t.name for t in QUANTIZED}
    for fmt_name, asms in code.items():
        quads = T[fmt_name] in {T(c) for c in kernels.quad_codes}
        multiply = ["vpdpbusd"] if vnni and quads else ["vpmaddubsw", "vpmaddwd"]  # Q8_0's pairs: widened, vpmaddwd
        for kind, asm in zip(("one-token", "tile"), asms, strict=True):
            found = sum(_instructions(asm, name, register) for name in multiply)
            assert found > 0, f"{isa} {fmt_name} {kind}: no {' or '.join(multiply)} on {register}"
            if register == "ymm":
                assert "%zmm" not in asm, f"{isa} {fmt_name} {kind}: a 512-bit register"


# ---- software prefetches in the one-token kernels of formats read in order ----------------------------------


def test_only_the_named_cpus_prefetch_in_order_formats() -> None:
    from engine.formats.emit import IN_ORDER_PREFETCH_AHEAD

    assert IN_ORDER_PREFETCH_AHEAD, "no CPU prefetches: the rest of these tests check nothing"
    for cpu, ahead in IN_ORDER_PREFETCH_AHEAD.items():
        assert simd.kernel_set(AVX512_VNNI, cpu=cpu).in_order_ahead == ahead > 0
    assert simd.kernel_set(AVX512_VNNI, cpu="znver4").in_order_ahead == 0
    assert simd.KERNELS.in_order_ahead == IN_ORDER_PREFETCH_AHEAD.get(simd.TARGET_NAME, 0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0])
def test_prefetching_one_token_kernels_give_the_same_sums(qtype: T) -> None:
    """The host's kernel set with and without software prefetches in its one-token kernels (as on a CPU that asks
    for them, whatever this CPU is): every group's sums are the same bit for bit, and the host's own, and only the
    prefetching one-token kernel asks for lines (in its LLVM IR)."""
    import dataclasses

    from numba import njit

    from engine.kernels import WeightMatrix, packed
    from tests.engine.test_kernels import random_blocks

    fmt = QUANTIZED[qtype]
    assert not fmt.prefetch  # read in order: prefetched only where the kernel set says so

    def one_token_group(in_order_ahead: int):
        one = simd._blocks(simd._one(fmt, dataclasses.replace(simd.KERNELS, in_order_ahead=in_order_ahead)), fmt)

        @njit
        def group(q, s, g, xq, dx, xsum, acc):
            qf, sf, nb, qstep, sstep = packed.flat_weight(q, s)
            xf, dxf, xsf = packed.flat_x(xq, dx, xsum)
            acc[:] = 0
            one(qf, g * nb * qstep, qstep, sf, g * nb * sstep, sstep, xf, dxf, xsf, nb, acc)

        return group

    rng = np.random.default_rng(int(qtype) + 950)
    rows, cols = 192, 1024
    w = WeightMatrix.from_raw("prefetch", qtype, rows, cols, random_blocks(qtype, rows, cols, rng)).prepare()
    p = w.packed
    xq, dx, xsum = packed.quantize_x(rng.standard_normal(cols).astype(np.float32))
    fetching, plain = one_token_group(8 << 10), one_token_group(0)
    got, want, host = (np.empty(packed.ROWS, np.float32) for _ in range(3))
    for g in range(p.q.shape[0]):
        fetching(p.q, p.s, g, xq, dx, xsum, got)
        plain(p.q, p.s, g, xq, dx, xsum, want)
        packed.group_simd(p.q, p.s, p.fmt, g, xq, dx, xsum, host)
        np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} group {g}")
        np.testing.assert_array_equal(host, want, err_msg=f"{qtype.name} group {g}")
    assert "llvm.prefetch" in fetching.inspect_llvm(fetching.signatures[0])
    assert "llvm.prefetch" not in plain.inspect_llvm(plain.signatures[0])
    kernels = dataclasses.replace(simd.KERNELS, in_order_ahead=8 << 10)
    tile = simd._tile(fmt, kernels)  # prefill's kernels read each weight for many tokens: no prefetches there

    @njit
    def tile_call(q, s, xq, xq2, dx, xsum, acc):
        tile(q.reshape(-1), 0, s.reshape(-1), 0, xq.reshape(-1), xq2.reshape(-1), 0, cols, dx.reshape(-1),
             xsum.reshape(-1), 0, cols // 32, acc)  # fmt: skip

    bufs = packed.row_buffers(simd.TILE, cols, paired=bool(packed.PAIRED[p.code]))
    acc = np.zeros(simd.TILE * packed.ROWS, np.float32)
    tile_call(p.q, p.s, bufs[0], bufs[3], bufs[1], bufs[2], acc)
    assert "llvm.prefetch" not in tile_call.inspect_llvm(tile_call.signatures[0])


def _longest_prefetch_run(asm: str) -> tuple[int, int]:
    """(prefetch instructions, the most of them in a row) in machine code as Numba's inspect_asm prints it."""
    ops = [line.split()[0] for line in asm.splitlines() if line.startswith("\t") and not line.startswith("\t.")]
    total = longest = run = 0
    for op in ops:
        run = run + 1 if op.startswith("prefetch") else 0
        total += op.startswith("prefetch")
        longest = max(longest, run)
    return total, longest


@pytest.mark.parametrize("qtype", sorted(QUANTIZED, key=int), ids=lambda q: q.name)
def test_one_token_kernels_spread_their_prefetches(qtype: T) -> None:
    """Each prefetch of a one-token kernel sits beside the load it runs ahead of: a chunk's 16-52 requests issued
    in one burst at its start left the core waiting on memory and computing by turns (Zen 5: Q4_K at 0.75 of the
    read, 0.90-0.96 spread). In the machine code: every format that prefetches has no more than a few requests in
    a row."""
    import dataclasses

    from numba import njit, typeof

    fmt = QUANTIZED[qtype]
    one = simd._blocks(simd._one(fmt, dataclasses.replace(simd.KERNELS, in_order_ahead=8 << 10)), fmt)

    @njit
    def group(q, s, xq, dx, xsum, nb, acc):
        one(q, 0, 1, s, 0, 1, xq, dx, xsum, nb, acc)

    arrays = (np.uint8, np.uint16, np.int8, np.float32, np.int32)  # q, s, xq, dx, xsum as flat arrays
    group.compile((*(typeof(np.zeros(1, t)) for t in arrays), typeof(1), typeof(np.zeros(1, np.float32))))
    total, longest = _longest_prefetch_run(group.inspect_asm(group.signatures[0]))
    assert total > 0, f"{qtype.name}: no prefetches in the one-token kernel"
    assert longest <= 4, f"{qtype.name}: {longest} prefetches in a row of {total}"
