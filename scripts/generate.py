"""Sample a completion from a prepared model, optionally with a LoRA adapter, to check a finetune by eye.

    python scripts/generate.py --model tiny --adapter out/adapter --prompt "Once upon a time"
    python scripts/generate.py --model tiny --adapter out/chat/adapter --chat --prompt "Who lit the lamp?"

With --chat the prompt is a user's message rendered through the model's chat template (with its
generation prompt), and the answer ends at the template's end-of-turn token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
from phantom.data import chat
from phantom.data.tokenizer import Tokenizer  # noqa: E402
from phantom.model.generate import generate_chat, generate_text  # noqa: E402
from phantom.model.adapterfiles import read_adapter_config  # noqa: E402
from phantom.stream.placement import offload_choices  # noqa: E402
from phantom.train import cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset name (weights/NAME) or a store folder")
    p.add_argument("--adapter", type=Path, default=None, help="LoRA adapter folder (PEFT layout) to apply")
    p.add_argument("--prompt", required=True, help="text to complete (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true", help="answer the prompt as the assistant, through the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="with --chat: a Jinja chat template (default: the model's own, from its store)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample at most")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 takes the argmax")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler")
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
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    lora = read_adapter_config(args.adapter) if args.adapter else None
    with phantom.load(args.model, device=args.device, offload=args.offload, dtype=args.dtype, lora=lora) as model:
        if args.adapter:
            model.load_adapter(args.adapter)
        tok_path = args.tokenizer or model.store.tokenizer_path
        if tok_path is None:
            raise FileNotFoundError(f"{model.store.path} has no tokenizer; pass --tokenizer FILE")
        tok, kw = Tokenizer(tok_path), dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                            top_k=args.top_k, seed=args.seed)
        if args.chat:
            template = chat.read_template(model.store.path, tok, args.chat_template)
            if template is None:
                raise ValueError(f"{model.store.path} has no chat template; pass --chat-template FILE")
            pieces = generate_chat(model, tok, template, args.prompt, args.system, **kw)
        else:
            pieces = generate_text(model, tok, args.prompt, **kw)
            print(args.prompt, end="", flush=True)
        for piece in pieces:
            print(piece, end="", flush=True)
        print()
    return 0


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
