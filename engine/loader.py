"""load_model: from a GGUF path to a ready Model, every check done before anything big is allocated.

With a device (CuPy on a CUDA GPU), the first `gpu_layers` layers -- or all of them and the output head -- are
uploaded once, here, and run there (engine.gpu); the rest stay on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from . import prompt_compile, runtime
from .cache_types import check_cache_type, row_bytes
from .config import ModelConfig
from .errors import ModelFileError, SettingsError
from .footprint import (
    install_numba_savings,
    release_free_heap,
    release_library_pages,
    release_library_pages_after_kernel_loads,
)
from .gguf_file import GGUFFile, open_gguf
from .gpu import normalize_device, offload_for, pick_backend, split_layers
from .model import Model
from .runtime import compile_progress, kernels_compiled, prune_kernel_folders
from .weights import Weights, bind_weights

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# Upper bound on the KV cache we agree to allocate, as a share of physical memory.
_MAX_CACHE_SHARE = 0.5


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 34


def load_model(
    path: str | os.PathLike[str],
    n_ctx: int = 2048,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
    gpu_layers: int = -1,
    compile_kernels: bool = True,
    requantize: GGMLQuantizationType | None = None,
    deterministic: bool = False,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
) -> Model:
    """Open, check and bind a GGUF model. Raises EngineError subclasses with one-line messages.

    device: "cpu" (the default here; the app's is "auto"); "cuda" (CuPy and a CUDA device, else
    engine.gpu.DeviceError); "auto" (cuda when usable, else the CPU and a line in `model.warnings` saying why);
    "gpu" means "cuda". "numpy" runs the device code path on NumPy arrays on the CPU, for tests.
    gpu_layers: as llama.cpp's -ngl. 0..n_layer: that many leading layers on the device, the output head on
    the CPU; -1 (the default), or n_layer + 1 and more: every layer and the output head.
    compile_kernels: run both kernel paths once before returning, compiling them on a first start (the prompt
    path in a second process, engine.prompt_compile). False leaves them to the first use.
    requantize: a type of engine.requantize.TYPES: the CPU's matrices re-encoded to it where that has fewer bits
    (a draft model's: its guesses are checked, so bytes matter more than precision). Not with a GPU.
    deterministic: every prompt row computed as decoding its token alone computes it (Model.deterministic).
    cache_type_k, cache_type_v: how the KV cache stores keys and values, engine.cache_types.CACHE_TYPES ("f16",
    "q8_0"), as llama.cpp's -ctk and -ctv.
    """
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    if not isinstance(n_ctx, int) or n_ctx < 1:
        raise SettingsError(f"context size must be a positive number of tokens (got {n_ctx!r})")
    if not isinstance(gpu_layers, int) or isinstance(gpu_layers, bool) or gpu_layers < -1:
        raise SettingsError(f"gpu layers must be -1 (all) or a number of layers >= 0 (got {gpu_layers!r})")
    cache_type_k = check_cache_type(cache_type_k, "cache type K")
    cache_type_v = check_cache_type(cache_type_v, "cache type V")
    device = normalize_device(device)
    backend, why_not = pick_backend(device) if gpu_layers != 0 else (None, "")
    runtime.configure_numba()
    install_numba_savings(runtime.kernel_cache_dir())
    release_library_pages()  # LLVM's pages that importing it touched
    release_library_pages_after_kernel_loads()  # and those each kernel load touches again
    started = runtime.start(threads)  # threads, wait policy, kernel set: before the first parallel launch
    n_threads = started.threads
    say("reading model header")
    file = open_gguf(path)
    embd = file.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise ModelFileError(f"{file.path.name}: tensor token_embd.weight: missing or not a matrix")
    cfg = ModelConfig.from_metadata(file.metadata, n_vocab=embd.shape[1])
    warnings = []
    if n_ctx > cfg.n_ctx_train:
        warnings.append(f"context {n_ctx} exceeds the model's trained {cfg.n_ctx_train}; using {cfg.n_ctx_train}")
        n_ctx = cfg.n_ctx_train
    n_device, with_output = split_layers(gpu_layers, cfg.n_layer) if backend is not None else (0, False)
    cache_rows = sum(cfg.cache_rows(li, n_ctx) for li in range(n_device, cfg.n_layer))  # rings: their window only
    row = row_bytes(cache_type_k, cfg.head_dim) + row_bytes(cache_type_v, cfg.head_dim)  # one position, K and V
    cache_bytes = cfg.n_kv_head * row * cache_rows
    if cache_bytes > _MAX_CACHE_SHARE * _physical_memory():
        raise SettingsError(
            f"a context of {n_ctx} tokens needs {cache_bytes / 2**30:.1f} GiB of KV cache, "
            f"more than half of this machine's memory"
        )
    first_start = compile_kernels and not kernels_compiled()
    prune_kernel_folders()  # this folder marked as used; kernel folders unused for a month go
    helper = prompt_compile.start(path) if first_start else None  # meanwhile: the tokenizer, the one-token path
    try:
        tokenizer = _tokenizer(file, cfg, warnings, say)
        say("checking tensors")
        weights = bind_weights(file, cfg)
        requantized = ""
        if requantize is not None and backend is None:
            weights, requantized = _requantize(weights, requantize, n_threads, say)
        elif requantize is not None and backend is not None:
            warnings.append(f"weights kept as stored on {backend.label}: re-encoding to {requantize.name} is CPU only")
        if why_not:
            warnings.append(why_not)
        offload, device = None, "cpu"
        if backend is not None:
            say(f"uploading {n_device} layers{' and the output' if with_output else ''} to {backend.label}")
            offload = offload_for(cfg, weights, n_ctx, backend, gpu_layers)
            device = f"{backend.label}, {n_device}/{cfg.n_layer} layers" + (" + output" if with_output else "")

        def warm_up(model: Model) -> None:
            if compile_kernels:
                _compile(model, helper, first_start, started.isa, say)
            release_free_heap()  # what loading parsed and dropped

        model = Model(
            file,
            cfg,
            weights,
            tokenizer,
            n_ctx=n_ctx,
            threads=n_threads,
            warnings=warnings,
            offload=offload,
            device=device,
            requantized=requantized,
            deterministic=deterministic,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            prepare=warm_up,
            started=t0,
        )
    finally:
        prompt_compile.stop(helper)
    return model


def _tokenizer(file: GGUFFile, cfg: ModelConfig, warnings: list[str], say: Callable[[str], None]) -> Tokenizer:
    """The file's tokenizer (its warnings added to `warnings`); the file's vocabulary strings are then dropped."""
    say("building tokenizer")
    from .tokenizer import Tokenizer  # noqa: PLC0415 (keeps `import engine` light)

    tokenizer = Tokenizer.from_metadata(file.metadata)
    if tokenizer.n_vocab > cfg.n_vocab:
        raise ModelFileError(
            f"{file.path.name}: vocabulary has {tokenizer.n_vocab} tokens but token_embd.weight only {cfg.n_vocab} rows"
        )
    warnings.extend(tokenizer.warnings)
    file.drop_vocabulary()
    release_free_heap()  # the vocabulary's strings, before the packed weights add to the peak
    return tokenizer


def _requantize(
    weights: Weights, to: GGMLQuantizationType, threads: int, say: Callable[[str], None]
) -> tuple[Weights, str]:
    """`weights` re-encoded to `to` where that has fewer bits, and what that saved, for display."""
    from .requantize import requantize_weights  # noqa: PLC0415 (only drafts need it)

    say(f"re-encoding weights as {to.name}")
    before = weights.decode_bytes()
    weights = requantize_weights(weights, to, threads)
    return weights, f"{to.name}, {before / 1e6:.0f} -> {weights.decode_bytes() / 1e6:.0f} MB a token"


def _compile(
    model: Model, helper: subprocess.Popen | None, first_start: bool, isa: str, say: Callable[[str], None]
) -> None:
    """Run the one-token and the prompt path once: kernels load from the cache, or compile on a first start."""
    if not first_start:
        say("loading kernels")
    else:
        beside = " (the prompt path in a second process)" if helper is not None else ""
        say(f"compiling kernels for {isa}{beside}: first start only")
    with compile_progress(lambda n, s: say(f"compiling kernels: {n} compiled in {s:.0f} s")) as compiled:
        t1 = time.perf_counter()
        if model.offload is None:
            # Every weight packed first: what each kernel load then touches of LLVM (released after it) comes on
            # top of the weights alone, not of the weights and a big output head's packing at once.
            for m in model.weights.products():
                m.prepare()
            for m in model.weights.products():
                m.release_file_pages()
        model.logits([0])  # the one-token (matvec) path
        prompt_compile.finish(helper)  # its kernels are in the cache now, or compile below
        prompt_compile.run_prompt_paths(model)
    if compiled() or helper is not None:
        say(f"{compiled()} kernels compiled in {time.perf_counter() - t1:.0f} s; later starts load them")
