"""Export a SAS or TACO checkpoint, pretrained or fine-tuned (any tensor-parallel size and
ZeRO stage), to a transformers model directory (taco-export-hf, tools/export_hf.py).

    python tools/export_hf.py --load ckpt --output sas_small_hf
    python tools/export_hf.py --load runs/cola/checkpoints --output sas_small_cola_hf

A fine-tuned checkpoint (tools/finetune.py's OUTPUT/checkpoints) becomes the task class of
its encoder's family, with the task's labels and a model card (cli/export_finetuned.py);
a pretrained one:

SAS / SAS^c -> ELECTRA: config.json + model.safetensors for ElectraForPreTraining (its
discriminator head is our RTD head: a positive logit means "replaced"); the same file
holds our MLM head as ELECTRA's generator head, which ElectraForMaskedLM loads.
SAS^DA -> DeBERTa-v2: config.json + model.safetensors for DebertaV2Model and, with the
legacy ``cls.predictions`` MLM head, DebertaV2ForMaskedLM; DeBERTa has no RTD head, so ours
is saved beside them as rtd_head.safetensors (ELECTRA's discriminator_predictions names:
dense, dense_prediction). Weights are the fp32 master weights where the optimizer kept them.

Tokenizer (save_tokenizer, in every export): tokenizer.json + tokenizer_config.json so that
``AutoTokenizer.from_pretrained`` loads a fast tokenizer equal to ours (sentencepiece unigram and BPE models, with or without
byte fallback: same normalisation, pieces and ids, [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3
[MASK]=4; it adds [CLS] ... [SEP]), plus the sentencepiece model itself as spm.model. A
WordPiece checkpoint (--tokenizer-type BertWordPiece*) gets BertTokenizerFast's files
(tokenizer.json, tokenizer_config.json, with its lower-casing) and the vocab.txt. The tokenizer is
the copy in the checkpoint's --save directory (or the file its metadata.json names).
TACO -> its own modeling code (cli/export_taco_hf.py): configuration_taco.py and
modeling_taco.py beside config.json (auto_map) and model.safetensors, loaded with
``trust_remote_code=True`` by AutoModel, AutoModelForMaskedLM (MLM and MPM heads) and the
sequence-classification, question-answering and multiple-choice Auto classes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from megatron_taco.arguments import program_name, run_cli
from megatron_taco.checkpoint.deepspeed_files import read_states
from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.checkpoint.plan import find_checkpoint
from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.cli import tool_parser
from megatron_taco.cli.export_finetuned import FAMILY_NAME, describe, family_of, save_finetuned
from megatron_taco.cli.export_taco_hf import restrict_tokenizer_inputs, save_taco_model
from megatron_taco.cli.hf_extra import require_hf_extra
from megatron_taco.data.tokenizer import WORDPIECE_TYPES, Tokenizer, load_tokenizer
from megatron_taco.errors import ConfigError
from megatron_taco.io import umask_mode
from megatron_taco.models.sas.hf import deberta_v2_config_and_state, electra_config_and_state
from megatron_taco.recipes.registry import (
    FINETUNED,
    checkpoint_tokenizer,
    finetuned_task,
    model_builder,
)

PROG = "export_hf.py"
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Checked after every export: the exported tokenizer must give our ids for it.
SAMPLE_TEXT = "The  quick brown fox, «naïve» café-owner, asked [MASK] twice: 42 ﬁsh? 😀 日本語"


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(PROG, __doc__, allow_abbrev=False)
    p.add_argument(
        "--load",
        required=True,
        help="SAS or TACO checkpoint directory: a pretraining --save (any ZeRO stage) or a "
        "fine-tuning run's OUTPUT/checkpoints.",
    )
    p.add_argument("--ckpt-step", type=int, help="Iteration to export (default: the latest).")
    p.add_argument("--output", required=True, help="New directory for the transformers files.")
    p.add_argument(
        "--tokenizer-model",
        help="The run's tokenizer file, sentencepiece model or WordPiece vocab.txt (default: "
        "its copy in the checkpoint's --save directory, else the file metadata.json names).",
    )
    return p


def _bpe_merges(proto) -> list[tuple[str, str]]:
    """Sentencepiece BPE keeps no merge list: it merges, at every step, the adjacent pair
    whose concatenation is the best-scored piece (score = -rank of the merge that made it).
    tokenizers' BPE merges the pair of lowest rank, so every split (left, right) of a piece
    into two pieces becomes a merge ranked by that piece's score, best first (splits of one
    piece ordered by their ids)."""
    ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = [(p.score, i, p.piece) for i, p in enumerate(proto.pieces) if p.type == p.NORMAL]
    merges = []
    for _, _, piece in sorted(normal, key=lambda x: (-x[0], x[1])):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        found = [(ids[a], ids[b], a, b) for a, b in splits if a in ids and b in ids]
        merges.extend((a, b) for _, _, a, b in sorted(found))
    return merges


def hf_tokenizer(spm_path: str):
    """A tokenizers.Tokenizer that segments like our sentencepiece model (unigram or BPE,
    with or without byte fallback): its pieces and scores (BPE: merges derived from them),
    its precompiled normalisation, sentencepiece's whitespace handling, byte pieces for
    characters outside the vocabulary when the model has them, the specials as added tokens
    and [CLS] $A [SEP] ([CLS] $A [SEP] $B [SEP]) on encoding."""
    import sentencepiece.sentencepiece_model_pb2 as spm_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers import pre_tokenizers as pre
    from tokenizers.models import BPE, Unigram

    proto = spm_pb2.ModelProto()
    with open(spm_path, "rb") as f:
        proto.ParseFromString(f.read())
    spec = proto.trainer_spec
    byte_fallback = bool(spec.byte_fallback)
    unk = proto.pieces[spec.unk_id].piece
    if spec.model_type == spm_pb2.TrainerSpec.UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
        model = Unigram(vocab, unk_id=spec.unk_id, byte_fallback=byte_fallback)
    elif spec.model_type == spm_pb2.TrainerSpec.BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        # fuse_unk: sentencepiece turns a run of unknown characters into one unknown piece.
        model = BPE(
            vocab, _bpe_merges(proto), unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback
        )
    else:
        kind = spm_pb2.TrainerSpec.ModelType.Name(spec.model_type).lower()
        raise ConfigError(
            f"--tokenizer-model: {spm_path} is a sentencepiece {kind} model; only unigram and "
            "bpe models are exported as transformers tokenizers"
        )
    tok = Tokenizer(model)
    # Sentencepiece collapses runs of spaces and drops trailing ones; the specials are matched
    # after normalisation (normalized=True), so this sees the whole text, as sentencepiece.
    steps = [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip(left=False)]
    if proto.normalizer_spec.precompiled_charsmap:
        steps.insert(0, normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    tok.normalizer = normalizers.Sequence(steps)
    # "first": only the text's first piece gets the "▁" of sentencepiece's dummy prefix, so
    # a word glued to a special ("[MASK]x") stays glued, as sentencepiece encodes it. (A text
    # that starts with a literal special is the one difference: sentencepiece puts a lone
    # "▁" piece before it.) Splitting at "▁" changes nothing for BPE either: sentencepiece
    # trains with split_by_whitespace, so no piece has a "▁" inside.
    tok.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme="first")
    metaspace = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    # Byte pieces <0xE2><0x9C><0x93> decode to the character they spell.
    tok.decoder = (
        decoders.Sequence([decoders.ByteFallback(), metaspace]) if byte_fallback else metaspace
    )
    tok.add_special_tokens([AddedToken(p, special=True, normalized=True) for p in SPECIALS])
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def save_wordpiece_tokenizer(vocab_file: str, tokenizer_type: str, out: str, max_length: int):
    """BertTokenizerFast's files, checked to give our ids on a sample text."""
    from transformers import BertTokenizerFast

    ours = load_tokenizer(vocab_file, tokenizer_type)
    # Positional: transformers 5.23's BertTokenizerFast(vocab_file=...) ignores the file
    # and maps every word to [UNK].
    tok = BertTokenizerFast(vocab_file, do_lower_case=ours.lower_case, model_max_length=max_length)
    if tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"] != ours.encode(SAMPLE_TEXT):
        raise ConfigError(
            f"--tokenizer-model: {vocab_file}: the exported BertTokenizerFast's ids differ from "
            "ours on a sample text"
        )
    tok.save_pretrained(out)
    # tokenizer.json holds the vocabulary too; vocab.txt is for BERT's and Megatron-LM's tools
    shutil.copy(vocab_file, os.path.join(out, "vocab.txt"))


def save_tokenizer(
    spm_path: str, out: str, max_length: int, tokenizer_type: str = "SentencePiece"
) -> None:
    if tokenizer_type in WORDPIECE_TYPES:
        save_wordpiece_tokenizer(spm_path, tokenizer_type, out, max_length)
        return

    tok = hf_tokenizer(spm_path)
    ours = Tokenizer(spm_path)
    if tok.encode(SAMPLE_TEXT, add_special_tokens=False).ids != ours.encode(SAMPLE_TEXT):
        raise ConfigError(
            f"--tokenizer-model: {spm_path} uses a normalisation the exported tokenizer does "
            "not reproduce (its ids differ from sentencepiece's on a sample text)"
        )
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        # The generic fast tokenizer loads tokenizer.json as it is; DebertaV2Tokenizer would
        # rebuild it without sentencepiece's normalisation.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS)),
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    shutil.copy(spm_path, os.path.join(out, "spm.model"))


def write_tokenizer(
    path: str, out: str, max_length: int, encoder: str, tokenizer_type: str = "SentencePiece"
) -> None:
    """The tokenizer files of every export (pretrained or fine-tuned) of an ``encoder``
    ("TACO" | "SAS") model."""
    save_tokenizer(path, out, max_length, tokenizer_type)
    if encoder == "TACO":
        restrict_tokenizer_inputs(out)


def special_token_ids(tokenizer) -> dict[str, int]:
    """The token ids of every exported config, read from the run's tokenizer: a WordPiece
    vocabulary keeps its specials where its file has them (BERT's [PAD] is 0, another
    vocab.txt's need not be). pad_token_id is the embedding's padding_idx in transformers
    (the row a further fine-tuning never updates); [CLS] / [SEP] are the bos / eos of
    transformers' BERT-family configs (RoBERTa's layout). [MASK] has no config field: the
    exported tokenizer carries it."""
    return {
        "pad_token_id": int(tokenizer.pad_id),
        "bos_token_id": int(tokenizer.cls_id),
        "eos_token_id": int(tokenizer.sep_id),
    }


def save_model(config, state_dict, out: str, special_ids: dict[str, int], *, task=None) -> None:
    """config.json + model.safetensors (+ rtd_head.safetensors for SAS^DA) of a SAS
    pretraining model; with ``task`` = (class name, config kwargs, head tensors), that task
    class from a fine-tuned encoder's state dict. ``special_ids``: special_token_ids of its
    tokenizer."""
    import transformers
    from safetensors.torch import save_file

    heads = task is None
    name, kwargs, head = task or (None, {}, {})
    if config.disentangled_attention:
        encoder, state, rtd = deberta_v2_config_and_state(config, state_dict, heads=heads)
        hf_config, name = transformers.DebertaV2Config, name or "DebertaV2ForMaskedLM"
        if heads:
            save_file(rtd, os.path.join(out, "rtd_head.safetensors"), metadata={"format": "pt"})
    else:
        encoder, state = electra_config_and_state(config, state_dict, heads=heads)
        hf_config, name = transformers.ElectraConfig, name or "ElectraForPreTraining"
    hf_config(**encoder, **kwargs, **special_ids, architectures=[name]).save_pretrained(out)
    save_file({**state, **head}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def export(args: argparse.Namespace, argv: list[str] | None = None) -> str:
    require_hf_extra(program_name(PROG))
    info = find_checkpoint(args.load, args.ckpt_step)
    if os.path.exists(args.output) and os.listdir(args.output):
        raise ConfigError(f"--output: {args.output} exists and is not empty")
    config, build = model_builder(info, args.tokenizer_model)
    states = read_states(info, ModelLayout(build, info.tp_size, config.vocab_size))
    tokenizer_path, tokenizer_type = checkpoint_tokenizer(info, args.tokenizer_model)
    special_ids = special_token_ids(load_tokenizer(tokenizer_path, tokenizer_type))
    task = finetuned_task(info) if info.model == FINETUNED else None
    encoder = task.encoder if task else info.model

    def write(tmp: str) -> None:
        write_tokenizer(
            tokenizer_path, tmp, config.max_position_embeddings, encoder, tokenizer_type
        )
        state_dict = states.full_state_dict()
        if task is not None:
            save_finetuned(info, config, task, state_dict, tmp, argv or [], special_ids)
        elif encoder == "TACO":
            save_taco_model(config, state_dict, tmp, special_ids)
        else:
            save_model(config, state_dict, tmp, special_ids)

    files = write_folder(args.output, write)
    kind = describe(task, config) if task else FAMILY_NAME[family_of(encoder, config)]
    return f"{info.iter_dir} -> {args.output} as {kind}: {', '.join(files)}"


def write_folder(output: str, write) -> list[str]:
    """``write(tmp)`` into a temporary folder beside ``output``, renamed to ``output`` once
    complete (removed on failure); returns the files' names."""
    tmp = f"{output.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        files = sorted(os.listdir(tmp))
        for name in files:  # safetensors writes 0600: others on the cluster could not read it
            umask_mode(os.path.join(tmp, name))
        if os.path.isdir(output):
            os.rmdir(output)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def main(argv: list[str] | None = None) -> int:
    # A missing transformers/safetensors (export) is a user error too: one line, exit 1.
    return run_cli(
        build_parser(),
        argv,
        lambda args: print(export(args, sys.argv[1:] if argv is None else argv)),
        user_errors=(CheckpointError, ImportError),
    )


if __name__ == "__main__":
    sys.exit(main())
