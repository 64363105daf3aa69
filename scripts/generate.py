"""Complete prompts with a prepared model, optionally with a LoRA adapter: one prompt to check a finetune by
eye, or a JSONL file of them in batches (each block read once per step for the whole batch).

    python scripts/generate.py --model tiny --adapter out/adapter --prompt "Once upon a time"
    python scripts/generate.py --model tiny --adapter out/chat/adapter --chat --prompt "Who lit the lamp?"
    python scripts/generate.py --model tiny --prompts prompts.jsonl --out completions.jsonl --max-new-tokens 64

With --chat the prompt is a user's message rendered through the model's chat template (with its
generation prompt), and the answer ends at the template's end-of-turn token.

--prompts: each line {"prompt": "..."} (with --chat, {"messages": [...]} or a prompt), optionally "seed"
(else --seed plus the line's index: a line samples the same completion whatever batch it runs in). --out gets
one line per input line, in input order: the input's fields plus "completion" (the new tokens decoded, special
tokens skipped, ending before the end-of-sequence or end-of-turn token or a --stop string) and
"completion_ids"; it is written whole at the end, or not at all.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
from phantom.base import fileio, safejson  # noqa: E402
from phantom.data import chat  # noqa: E402
from phantom.data.tokenizer import Tokenizer  # noqa: E402
from phantom.model.generate import Request, Sampling, generate_chat, generate_many, generate_text  # noqa: E402
from phantom.model.adapterfiles import read_adapter_config  # noqa: E402
from phantom.stream.placement import offload_choices  # noqa: E402
from phantom.train import cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset name (weights/NAME) or a store folder")
    p.add_argument("--adapter", type=Path, default=None, help="LoRA adapter folder (PEFT layout) to apply")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to complete (with --chat: the user's message)")
    what.add_argument("--prompts", type=Path, metavar="IN.jsonl", help="a JSONL file of prompts, completed in batches")
    p.add_argument("--out", type=Path, metavar="OUT.jsonl", help="with --prompts: where the completions go")
    p.add_argument("--batch-size", type=int, default=None,
                   help="with --prompts: sequences per batch (default: as many as the memory free holds)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="with --prompts: a string that ends a completion (cut before it); repeat for several")
    p.add_argument("--chat", action="store_true", help="answer the prompt as the assistant, through the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="with --chat: a Jinja chat template (default: the model's own, from its store)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample at most")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 takes the argmax")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (--prompts: of the first line)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.model or tokenizer.json (default: the one in the store)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--offload", choices=offload_choices(), default="disk",
                   help="where the blocks live: streamed from disk or RAM, all on the device, or in a tier an "
                        "installed package declares (entry points phantom.tiers)")
    p.add_argument("--dtype", choices=cli.STORE_DTYPES, default="fp32", help="compute dtype")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.prompts is not None and args.out is None:
        p.error("--prompts needs --out")
    if args.prompts is None and (args.out is not None or args.batch_size is not None or args.stop):
        p.error("--out, --batch-size and --stop go with --prompts")
    if args.batch_size is not None and args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    records = read_prompts(args.prompts, args.chat) if args.prompts else None  # bad input: before the model loads
    lora = read_adapter_config(args.adapter) if args.adapter else None
    with phantom.load(args.model, device=args.device, offload=args.offload, dtype=args.dtype, lora=lora) as model:
        if args.adapter:
            model.load_adapter(args.adapter)
        tok_path = args.tokenizer or model.store.tokenizer_path
        if tok_path is None:
            raise FileNotFoundError(f"{model.store.path} has no tokenizer; pass --tokenizer FILE")
        tok = Tokenizer(tok_path)
        template = None
        if args.chat:
            template = chat.read_template(model.store.path, tok, args.chat_template)
            if template is None:
                raise ValueError(f"{model.store.path} has no chat template; pass --chat-template FILE")
        if records is not None:
            return complete_file(model, tok, template, records, args)
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed)
        if template is not None:
            pieces = generate_chat(model, tok, template, args.prompt, args.system, **kw)
        else:
            pieces = generate_text(model, tok, args.prompt, **kw)
            print(args.prompt, end="", flush=True)
        for piece in pieces:
            print(piece, end="", flush=True)
        print()
    return 0


def read_prompts(path: Path, use_chat: bool) -> list[dict]:
    """The records of a prompts file, each with a "prompt" string (or with --chat a "messages" list)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    records = []
    for n, record in safejson.read_records(path):
        ok = isinstance(record, dict) and (isinstance(record.get("prompt"), str) or
                                           use_chat and isinstance(record.get("messages"), list))
        if not ok:
            need = '{"prompt": "..."} or {"messages": [...]}' if use_chat else '{"prompt": "..."}'
            raise ValueError(f"{path}:{n}: each line must be an object like {need}")
        if "seed" in record and (not isinstance(record["seed"], int) or isinstance(record["seed"], bool)):
            raise ValueError(f"{path}:{n}: \"seed\" must be an integer")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def complete_file(model, tok: Tokenizer, template, records: list[dict], args) -> int:
    if template is not None:
        stop = frozenset(chat.end_of_turn_ids(tok, template))
        ids = [chat.messages_ids(tok, template, r["messages"]) if "messages" in r else
               chat.prompt_ids(tok, template, r["prompt"], args.system) for r in records]
    else:
        stop = frozenset(tok.stop_ids)  # generation_config.json's eos_token_id, else EOS
        ids = [tok.encode(r["prompt"], bos=True) for r in records]
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    requests = [Request(list(i), args.max_new_tokens, sampling, r.get("seed", args.seed + n), stop, tuple(args.stop))
                for n, (i, r) in enumerate(zip(ids, records))]
    done = generate_many(model, requests, tok, batch_size=args.batch_size, progress=True)
    lines = [json.dumps({**r, "completion": c.text, "completion_ids": c.ids}, ensure_ascii=False)
             for r, c in zip(records, done)]
    fileio.atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"{len(lines)} completions, {sum(len(c.ids) for c in done)} tokens -> {args.out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
