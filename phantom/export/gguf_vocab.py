"""A GGUF file's tokenizer keys (tokenizer.ggml.*), read from the tokenizer files an HF export carries.

What llama.cpp's convert_hf_to_gguf.py writes for the same folder: a sentencepiece tokenizer.model
(model "llama": pieces, scores, types), a Llama-style tokenizer.json without one (gguf's LlamaHfVocab), or a
byte-level BPE tokenizer.json (model "gpt2": tokens, types, merges, and the pre-tokenizer's llama.cpp name,
found by hashing how it splits gguf_pretok.CHECK_TEXT); then gguf's SpecialVocab for the special ids,
add-BOS/EOS flags and the chat template. May import gguf, sentencepiece and phantom.data.
"""
from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import gguf

from phantom.data.tokenizer import Tokenizer
from phantom.export.gguf_pretok import CHECK_TEXT, PRE_TOKENIZERS

SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED, SP_UNUSED, SP_BYTE = 1, 2, 3, 4, 5, 6  # sentencepiece's types
SPACE = "\u2581"  # sentencepiece's word mark; llama.cpp wants user-defined tokens' spaces as spaces


def sp_piece(sp, i: int) -> tuple[bytes, float, int]:
    """A sentencepiece piece as llama.cpp's converter writes it: its bytes, score and token type."""
    kind = (SP_UNKNOWN if sp.IsUnknown(i) else SP_CONTROL if sp.IsControl(i) else
            SP_UNUSED if sp.IsUnused(i) else SP_BYTE if sp.IsByte(i) else SP_NORMAL)
    return sp.IdToPiece(i).encode(), sp.GetScore(i), kind


def looks_special(token: str) -> bool:
    """Added tokens llama.cpp treats as control though a tokenizer may not flag them special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def sentencepiece_vocab(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """Pieces, scores and types of tokenizer.model, padded to vocab_size, with added_tokens.json and
    tokenizer_config.json's added_tokens_decoder laid over them (as the converter's
    _create_vocab_sentencepiece)."""
    from sentencepiece import SentencePieceProcessor
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [SP_UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        tokens[i], scores[i], types[i] = sp_piece(sp, i)
    for text, i in read_json(folder / "added_tokens.json").items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, SP_USER_DEFINED
    for i, data in read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {}).items():
        i, text = int(i), data["content"]
        if i >= vocab_size:
            continue
        special = data.get("special") or looks_special(text)
        types[i] = SP_CONTROL if special else SP_USER_DEFINED
        tokens[i], scores[i] = (text if special else text.replace(SPACE, " ")).encode(), -1000.0
    return tokens, scores, types


def bpe_vocab(folder: Path, vocab_size: int, spec: dict) -> tuple[list[str], list[int]]:
    """tokenizer.json's tokens by id up to vocab_size ([PADi] where none), typed as the converter's
    get_vocab_base types them: added ones control (special, or looking it) or user-defined, else normal
    (spec: tokenizer.json, read)."""
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id = {i: text for text, i in spec["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(f"{folder}: the tokenizer has ids up to {max(by_id)}, past the model's {vocab_size} rows")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            special = added[i].get("special") or looks_special(by_id[i])
            tokens.append(by_id[i] if special else by_id[i].replace(SPACE, " "))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def pre_tokenizer(folder: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: the sha256 of the ids (with the tokens the
    model adds, as transformers encodes) of CHECK_TEXT, looked up in llama.cpp's table."""
    ids = Tokenizer(folder / "tokenizer.json").encode(CHECK_TEXT, bos=True)
    digest = sha256(str(ids).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise ValueError(f"{folder / 'tokenizer.json'}: its BPE pre-tokenizer is not one llama.cpp knows (sha256 "
                         f"{digest[:16]}...), so llama.cpp could not split text as it does; use --format hf")
    return PRE_TOKENIZERS[digest]


def llama_hf_vocab(folder: Path):
    """gguf's LlamaHfVocab of a Llama-style tokenizer.json (sentencepiece-style BPE with byte fallback), or None."""
    try:
        return gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError):
        return None


def phi3_vocab(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """Phi3MiniModel's own reading of tokenizer.model: sentencepiece's pieces padded to vocab_size, then
    added_tokens.json, tokenizer_config.json's added_tokens_decoder and tokenizer.json's added tokens laid
    over them as they are (score -1000, control where flagged special, else user-defined)."""
    from sentencepiece import SentencePieceProcessor
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [SP_UNUSED] * vocab_size
    for i in range(sp.vocab_size()):
        tokens[i], scores[i], types[i] = sp_piece(sp, i)
    for text, i in read_json(folder / "added_tokens.json").items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, SP_USER_DEFINED
    decoder = read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    added = [(int(i), d) for i, d in decoder.items()] + \
        [(int(d["id"]), d) for d in read_json(folder / "tokenizer.json").get("added_tokens", [])]
    for i, data in added:
        tokens[i], scores[i] = data["content"].encode(), -1000.0
        types[i] = SP_CONTROL if data.get("special") else SP_USER_DEFINED
    return tokens, scores, types


class ConverterVocab(gguf.SpecialVocab):
    """gguf's SpecialVocab as the converter of the pinned llama-cpp-python release (tests/conftest.py's
    LLAMA_CPP: its gguf-py is newer than the gguf package's 0.19.0) reads tokenizer.json and tokenizer_config.json:
    a post-processor's add-BOS/EOS/SEP flags win over tokenizer_config.json's add_*_token (a ByteLevel one adds
    neither BOS nor EOS where nothing before it says), a TemplateProcessing's leading special token is BOS (and CLS)
    where the config names none, and the normalizer's lowercase and strip_accents are written. The merges and
    the chat template are the package's reading."""

    def _try_load_from_tokenizer_json(self, path: Path) -> bool:
        types = tuple(self.special_token_types)
        loaded = super()._try_load_from_tokenizer_json(path)
        self.normalizer = {}
        if not (path / "tokenizer.json").is_file():
            return loaded
        spec = read_json(path / "tokenizer.json")
        config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else None
        self.normalizer = normalizer_flags(spec.get("normalizer") or {})
        self.special_token_types, self.add_special_token, self.special_token_ids = types, {}, {}
        post_processor_flags(self, spec, config)
        if config:
            added = spec.get("added_tokens", {})
            for typ in self.special_token_types:  # the config's flags where the post-processor set none; the ids
                if isinstance(add := config.get(f"add_{typ}_token"), bool) and typ not in self.add_special_token:
                    self.add_special_token[typ] = add
                entry = config.get(f"{typ}_token")
                content = entry.get("content") if isinstance(entry, dict) else entry
                if isinstance(content, str):
                    self._set_special_token(typ, next((t.get("id") for t in added if t.get("content") == content),
                                                      None))
        return True

    def add_to_gguf(self, gw: gguf.GGUFWriter, quiet: bool = False) -> None:
        super().add_to_gguf(gw, quiet)
        for key in ("lowercase", "strip_accents"):
            if key in self.normalizer:
                gw.add_bool(f"tokenizer.ggml.normalizer.{key}", self.normalizer[key])


def normalizer_flags(normalizer: dict) -> dict[str, bool]:
    """{"lowercase", "strip_accents": bool} a tokenizer.json normalizer sets (standalone, BertNormalizer's
    attributes, or nested in a Sequence; the last one read wins)."""
    kind, out = normalizer.get("type"), {}
    if kind == "Lowercase":
        out["lowercase"] = True
    elif kind == "StripAccents":
        out["strip_accents"] = True
    elif kind == "BertNormalizer":
        out.update({k: normalizer[k] for k in ("lowercase", "strip_accents") if k in normalizer})
    elif kind == "Sequence":
        for norm in normalizer.get("normalizers", []):
            out.update(normalizer_flags(norm))
    return out


def post_processor_flags(vocab: gguf.SpecialVocab, spec: dict, config: dict | None) -> None:
    """vocab.add_special_token as the converter reads tokenizer.json's post-processor (each of a Sequence's in
    turn), config (tokenizer_config.json, or None) given the special tokens it implies: CLS as BOS and SEP as EOS
    where those are not named, RobertaProcessing's, TemplateProcessing's leading and trailing ones."""
    tokens = {t: (config or {}).get(f"{t}_token") for t in ("bos", "cls", "eos", "sep")}
    if not tokens["bos"] and tokens["cls"] and config:
        config["bos_token"] = tokens["bos"] = tokens["cls"]
    if not tokens["eos"] and tokens["sep"] and config:
        config["eos_token"] = tokens["eos"] = tokens["sep"]
    post = spec.get("post_processor")
    for processor in (post.get("processors", [post]) if post else []):
        kind = processor.get("type")
        if kind == "ByteLevel":
            vocab.add_special_token.setdefault("bos", False)
            vocab.add_special_token.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            vocab.add_special_token.update(bos=True, eos=True, sep=True)
            if not tokens["cls"] and config:
                config["cls_token"] = tokens["cls"] = processor.get("cls", [tokens["bos"]])[0]
            if not tokens["sep"] and config:
                config["sep_token"] = tokens["sep"] = processor.get("sep", [tokens["eos"]])[0]
        elif kind == "TemplateProcessing":
            template_flags(vocab, processor, config, tokens)


def template_flags(vocab: gguf.SpecialVocab, processor: dict, config: dict | None, tokens: dict) -> None:
    """A TemplateProcessing's flags (the converter's crude reading of simple templates): BOS where the single
    template opens on BOS or CLS (naming them where the config does not), EOS where it closes on EOS (the config's
    EOS moved to EOT, or EOM, where it closes on another), SEP where the pair template puts SEP or EOS between A
    and B."""
    single, pair, first, last = processor.get("single", []), processor.get("pair", []), None, None
    if len(single) > 1:
        if first := single[0].get("SpecialToken", {}).get("id"):
            if not config:
                tokens["bos"] = first
            elif first not in (tokens["bos"], tokens["cls"]):
                if not tokens["bos"]:
                    config["bos_token"] = tokens["bos"] = first
                if not tokens["cls"]:
                    config["cls_token"] = tokens["cls"] = first
            vocab.add_special_token["bos"] = first in (tokens["bos"], tokens["cls"])
        if last := single[-1].get("SpecialToken", {}).get("id"):
            if not config:
                tokens["eos"] = last
            elif last != tokens["eos"]:
                for extra in ("eot", "eom"):
                    if extra not in vocab.special_token_types:
                        vocab.special_token_types = (*vocab.special_token_types, extra)
                        config[f"{extra}_token"] = tokens["eos"]
                        break
                config["eos_token"] = tokens["eos"] = last
            vocab.add_special_token["eos"] = last == tokens["eos"]
    if pair:
        start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
        stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
        if (pair := pair[slice(start, stop)]) and pair[0].get("Sequence", {}).get("id") == "A" and \
                pair[-1].get("Sequence", {}).get("id") == "B" and (pair := pair[1:-1]):
            seps = [p.get("SpecialToken", {}).get("id") for p in pair[:2]]
            add = bool(seps[0] in (tokens["sep"], tokens["eos"]) and seps[0] and not last) or \
                bool(len(pair) == 2 and seps[1] and seps[1] in (tokens["sep"], tokens["eos"]))
            vocab.add_special_token["sep"] = add
            if add and not tokens["sep"] and config:
                config["sep_token"] = tokens["eos"]


GLM_SPECIAL = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}


def glm_special_tokens(special: gguf.SpecialVocab, folder: Path, spec: dict) -> None:
    """The converter's _set_vocab_glm: GLM's BOS, end-of-turn, unknown and end-of-message ids from its added tokens
    (each where tokenizer_config.json names none; spec: tokenizer.json, read)."""
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if missing := [text for text in GLM_SPECIAL.values() if text not in added]:
        raise ValueError(f"{folder / 'tokenizer.json'}: llama.cpp's converter reads GLM's special tokens "
                         f"{', '.join(GLM_SPECIAL.values())} from its added tokens, and {', '.join(missing)} "
                         f"is not among them; use --format hf")
    for kind, text in GLM_SPECIAL.items():
        special._set_special_token(kind, added[text])


def add_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int, kind: str) -> None:
    """Write the tokenizer keys for the files in folder as the family's converter class reads them (kind:
    gguf_arch.Arch.vocab): "llama" tries tokenizer.model, a Llama-style tokenizer.json, then byte-level BPE;
    "sentencepiece" tokenizer.model, then byte-level BPE; "bpe" byte-level BPE alone; "glm" byte-level BPE with
    GLM's special ids; "phi3" its own reading
    of tokenizer.model, or byte-level BPE where tokenizer_config.json names GPT2Tokenizer (Phi-4)."""
    gpt2 = read_json(folder / "tokenizer_config.json").get("tokenizer_class") == "GPT2Tokenizer"
    if kind == "phi3" and not gpt2:
        if not (folder / "tokenizer.model").is_file():
            raise ValueError(f"{folder}: llama.cpp's converter reads Phi-3's vocabulary from tokenizer.model (or a "
                             f"GPT2Tokenizer's tokenizer.json), and there is neither; use --format hf")
        tokens, scores, types = phi3_vocab(folder, vocab_size)
        model = "llama"
    elif kind in ("llama", "sentencepiece") and (folder / "tokenizer.model").is_file():
        tokens, scores, types = sentencepiece_vocab(folder, vocab_size)
        model = "llama"
    elif kind == "llama" and (vocab := llama_hf_vocab(folder)) is not None:
        tokens, scores, types = map(list, zip(*vocab.all_tokens()))
        model = "llama"
    else:
        spec = read_json(folder / "tokenizer.json")
        tokens, types = bpe_vocab(folder, vocab_size, spec)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(folder))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special = ConverterVocab(folder, load_merges=True)
        if kind == "glm":
            glm_special_tokens(special, folder, spec)
        special.add_to_gguf(writer)
        return
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    ConverterVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)


# llama.cpp's vocabulary loader (llama-vocab.cpp, load) sets these tokens' attributes, found by their text, in a
# model whose general.name contains phi3 or phi-3, and fails to load one whose vocabulary lacks any of them
PHI3_NAMED_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def phi3_name_refusal(name: str, tokens: list) -> str | None:
    """Why llama.cpp would not load this vocabulary under this general.name (a Phi-3 name whose vocabulary lacks
    a token llama.cpp looks up by its text), or None. Every published Phi-3 vocabulary has them."""
    if not any(mark in name.lower() for mark in ("phi3", "phi-3")):
        return None
    texts = {t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in tokens}
    if not (missing := [t for t in PHI3_NAMED_TOKENS if t not in texts]):
        return None
    return (f"llama.cpp looks up {', '.join(PHI3_NAMED_TOKENS)} by their text in a model named as Phi-3 (this "
            f"file's name is {name!r}) and does not load one without them, and this vocabulary lacks "
            f"{', '.join(missing)}; name the store's folder without phi3 or phi-3, or add the tokens")
