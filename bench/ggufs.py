"""Models as people download them: real shapes with random weights, made into GGUF files by llama.cpp's
own converter and quantiser, offline, and served on their blocks beside llama.cpp on the same file.

    python -m bench.ggufs [--shapes llama-3.2-1b] [--formats Q4_K_M Q8_0 F16] [--threads 1 all]
                          [--rounds 2] [--work DIR] [--json FILE]

Each shape gets random weights (bfloat16 safetensors, SmolLM2's tokenizer), ``convert_hf_to_gguf.py``
from llama-cpp-python's source distribution (downloaded once with pip, or ``--llama-cpp-source``) makes
an F16 GGUF and ``llama_model_quantize`` the other formats. Then, per format and thread count, in
fresh processes that alternate (ours, llama.cpp, ours, ...): one stream's decoding tokens/s, 8 streams'
(ours), the time to the first token of a 1,000-token prompt, the process's RSS after it, and the
bytes a decoding step reads against this machine's memory bandwidth (``torch.sum`` of 1 GiB, same
thread count): how close each engine comes to its bound. Ours is the engine in process (the worker's
decoder, no HTTP or Redis: ``bench.throughput`` measures those). Needs ``llama-cpp-python`` (README,
"Benchmarks") and ``sentencepiece``.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bench.report import Table, ratio

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "tie_word_embeddings": True},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True},
}
# llama.cpp's file types (llama.h, llama_ftype) of the formats people download
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3}
PROMPT_TOKENS = 1000
DECODE_TOKENS = 32
STREAMS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"], choices=sorted(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["Q4_K_M", "Q8_0", "F16", "BF16-dir"],
                        help=f"of {', '.join(FTYPES)}, F16 and BF16-dir (the safetensors directory)")
    parser.add_argument("--threads", nargs="+", default=["1", "all"], help="thread counts; 'all': every core")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternating")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "lmsp" / "bench-ggufs")
    parser.add_argument("--llama-cpp-source", type=Path, help="llama.cpp's tree (with convert_hf_to_gguf.py)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "FILE", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine, path, threads = args.child
        print(json.dumps(_ours(Path(path), int(threads)) if engine == "ours" else _llama(Path(path), int(threads))))
        return
    counts = [os.cpu_count() or 1 if t == "all" else int(t) for t in args.threads]
    source = args.llama_cpp_source or _llama_cpp_source(args.work)
    results = []
    for shape in args.shapes:
        for fmt in args.formats:
            path = _gguf(shape, fmt, args.work, source)
            for threads in counts:
                results.append(_compare(shape, fmt, path, threads, args.rounds))
                print(json.dumps(results[-1]), flush=True)
    print(_table(results))
    if args.json:
        command = " ".join(["python -m bench.ggufs", *sys.argv[1:]])
        args.json.write_text(json.dumps({"command": command, "cpu": _cpu(), "results": results}, indent=1))


# --- the files --------------------------------------------------------------------------------------------


def _llama_cpp_source(work: Path) -> Path:
    """llama.cpp's tree from llama-cpp-python's source distribution (the installed version's), once."""
    import llama_cpp

    version = llama_cpp.__version__
    tree = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                        f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(work / f"llama_cpp_python-{version}.tar.gz") as archive:
            archive.extractall(work, filter="data")
    return tree


def _gguf(shape: str, fmt: str, work: Path, source: Path) -> Path:
    """``shape`` as a GGUF file in ``fmt``, made once (``BF16-dir``: the bfloat16 model directory itself,
    beside llama.cpp on the F16 file)."""
    if fmt == "BF16-dir":
        _gguf(shape, "F16", work, source)
        return _random_model(shape, work)
    path = work / f"{shape}-{fmt.lower()}.gguf"
    if path.exists():
        return path
    f16 = work / f"{shape}-f16.gguf"
    if not f16.exists():
        model = _random_model(shape, work)
        subprocess.run([sys.executable, "-c", _CONVERT, str(source / "convert_hf_to_gguf.py"), str(model), "--outfile",
                        str(f16.with_suffix(".tmp")), "--outtype", "f16"], check=True)
        f16.with_suffix(".tmp").rename(f16)
    if fmt != "F16":
        _quantize(f16, path, FTYPES[fmt])
    return path


# llama.cpp's converter, with the tokenizer the directory's tokenizer.json defines: transformers 5 picks a
# class by the model's type (Qwen2's own pre-tokenizer for a qwen2 directory), whose tokens the converter
# does not recognise for SmolLM2's vocabulary
_CONVERT = """
import runpy, sys
from pathlib import Path
import transformers
original = transformers.AutoTokenizer.from_pretrained
def from_pretrained(path, *args, **kwargs):
    file = Path(path) / "tokenizer.json"
    if file.exists():
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
    return original(path, *args, **kwargs)
transformers.AutoTokenizer.from_pretrained = from_pretrained
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).parent))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _random_model(shape: str, work: Path) -> Path:
    """A model directory of ``shape``: random weights in bfloat16, SmolLM2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmsp_core.requests.catalog import SMOLLM2
    from lmsp_core.requests.modelfiles import gguf_file

    target = work / f"{shape}-hf"
    if (target / "config.json").exists():
        return target
    smollm2 = gguf_file(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer), max_position_embeddings=8192,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _quantize(source: Path, target: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, os.cpu_count() or 1
    staging = target.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {target.name}")
    staging.rename(target)


# --- one engine, one file, one thread count, in a process of its own --------------------------------------


def _compare(shape: str, fmt: str, path: Path, threads: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "llama.cpp": []}
    for _ in range(rounds):
        for engine in runs:
            runs[engine].append(_child(engine, path, threads))
    medians = {engine: {key: statistics.median(run[key] for run in found) for key in found[0] if found[0][key]
                        is not None} for engine, found in runs.items()}
    bandwidth = _child("bandwidth", path, threads)["bytes_per_second"]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size
    return {"shape": shape, "format": fmt, "file_bytes": size, "threads": threads,
            "bandwidth": bandwidth, **{f"{engine} {key}": value for engine, found in medians.items()
                                      for key, value in found.items()}}


def _child(engine: str, path: Path, threads: int) -> dict[str, Any]:
    if engine == "bandwidth":
        return _bandwidth(threads)
    done = subprocess.run([sys.executable, "-m", "bench.ggufs", "--child", engine, str(path), str(threads)],
                          capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _bandwidth(threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(1 << 28)  # 1 GiB of float32
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return {"bytes_per_second": data.nbytes / best}


def _timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _rss() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "peak_rss": int(status["VmHWM"].split()[0]) * 1024}


def _ours(path: Path, threads: int) -> dict[str, Any]:
    import torch

    from lmsp_core.requests.catalog import ModelSpec
    from workers.model import build, loader
    from workers.model.decoder import Decoder
    from workers.model.plan import Chunk, Feed, StepPlan

    loader.limit_threads(threads)
    source = f"hf-dir:{path}" if path.is_dir() else f"gguf-file:{path}"
    spec = ModelSpec(id=path.stem, source=source, context_window=2048, max_output_tokens=256,
                     capabilities=[], max_batch_size=STREAMS)
    started = time.perf_counter()
    decoder = build.slot_model(loader.load(spec, path.parent / "cache"), compile=False)
    assert isinstance(decoder, Decoder), "an architecture the slot decoder runs"
    load = time.perf_counter() - started
    prompt = list(range(1000, 1032))
    with torch.inference_mode():
        for slot in range(STREAMS):
            decoder.run(StepPlan(chunks=[Chunk(slot=slot, start=0, tokens=prompt, last=True)]))

        def steps(streams: int) -> float:
            return _timed(lambda: [decoder.run(StepPlan(feeds=[Feed(slot=s, token=5, position=len(prompt) + i)
                                                              for s in range(streams)]))
                                   for i in range(DECODE_TOKENS)])

        one, eight = steps(1), steps(STREAMS)
        long = list(range(2000, 2000 + PROMPT_TOKENS))
        ttft = _timed(lambda: [decoder.run(StepPlan(chunks=[Chunk(slot=1, start=c, tokens=long[c:c + 256],
                                                                  last=c + 256 >= PROMPT_TOKENS)]))
                               for c in range(0, PROMPT_TOKENS, 256)])
    return {"tokens_per_second": DECODE_TOKENS / one, "8_streams": STREAMS * DECODE_TOKENS / eight,
            "ttft_1000": ttft, "step_bytes": decoder.step_bytes(len(prompt)), "load_seconds": load, **_rss()}


def _llama(path: Path, threads: int) -> dict[str, Any]:
    import llama_cpp

    if path.is_dir():  # a model directory: llama.cpp reads its F16 file
        path = path.with_name(path.name.removesuffix("-hf") + "-f16.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                          verbose=False)
    prompt = list(range(1000, 1032))
    llm.eval(prompt)
    one = _timed(lambda: [llm.eval([5]) for _ in range(DECODE_TOKENS)])
    llm.reset()
    ttft = _timed(lambda: llm.eval(list(range(2000, 2000 + PROMPT_TOKENS))))
    return {"tokens_per_second": DECODE_TOKENS / one, "8_streams": None, "ttft_1000": ttft,
            "step_bytes": path.stat().st_size, **_rss()}


# --- the table -----------------------------------------------------------------------------------------------


def _table(results: list[dict[str, Any]]) -> str:
    print(f"GGUF models on their blocks against llama.cpp, {_cpu()}")
    table = Table(head=("measure", "ours", "llama.cpp", "ratio", "target"), echo=False)
    for r in results:
        name = f"{r['shape']} {r['format']} ({r['file_bytes'] / 1e9:.2f} GB), {r['threads']} thread(s)"
        ours, theirs = r["ours tokens_per_second"], r["llama.cpp tokens_per_second"]
        table.add(f"{name}: 1 stream tok/s", f"{ours:.1f}", f"{theirs:.1f}", ratio(ours, theirs), ">= 1.0x")
        table.add(f"{name}: 8 streams tok/s", f"{r['ours 8_streams']:.1f}", "", f"{r['ours 8_streams'] / ours:.2f}x "
                  "ours at 1", ">= 2.5x")
        table.add(f"{name}: TTFT 1,000 tokens s", f"{r['ours ttft_1000']:.2f}", f"{r['llama.cpp ttft_1000']:.2f}",
                  ratio(r["llama.cpp ttft_1000"], r["ours ttft_1000"]), ">= 1.0x")
        bound = r["bandwidth"] / r["ours step_bytes"]
        table.add(f"{name}: decoding / memory bound", f"{ours / bound:.0%} of {bound:.1f} tok/s",
                  f"{theirs * r['llama.cpp step_bytes'] / r['bandwidth']:.0%}", "", "")
        table.add(f"{name}: RSS GB", f"{r['ours rss'] / 1e9:.2f} (peak {r['ours peak_rss'] / 1e9:.2f})",
                  f"{r['llama.cpp rss'] / 1e9:.2f}", "", "<= file + KV + 0.6")
    return table.render()


def _cpu() -> str:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in fields.get("flags", "")]
    return (f"{fields.get('model name')} family {fields.get('cpu family')} model {fields.get('model')} "
            f"[{' '.join(flags)}], {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
