"""--show-data: training rows as the model sees them. Every token is shown, special tokens by their
text (<|im_start|>, <start_of_turn>, BOS, EOS), so whether the chat template was applied can be seen;
runs of tokens that carry loss are inside [[ ]], each packed example on its own line; with ids, each
token is followed by its id in ⟨ ⟩.
"""
from __future__ import annotations

from phantom.data.batches import Packed, Windows
from phantom.data.dataset import IGNORE_INDEX
from phantom.data.tokenizer import Tokenizer


def show_rows(ds: Windows | Packed, tok: Tokenizer | None, n: int, ids: bool = False) -> str:
    """The first n rows as text: a header line per row, then one line per packed example (padding as a
    count). ids: each token's id beside it."""
    lines = []
    for i in range(min(n, len(ds) if isinstance(ds, Packed) else ds.n_sequential)):
        x, y, *seg = ds[i if isinstance(ds, Packed) else i * ds.seq_len]
        seg = seg[0].tolist() if seg else [0] * len(x)
        trained = [False] + (y[:-1] != IGNORE_INDEX).tolist()  # token t is the target of position t - 1
        n_ex = len(set(seg)) - (isinstance(ds, Packed) and any(s == len(ds.rows[i]) for s in seg))
        lines.append(f"-- row {i}: {len(x)} tokens, {int((y != IGNORE_INDEX).sum())} trained, {n_ex} example(s)")
        row = x.tolist()
        if y[-1] != IGNORE_INDEX:  # the row's last target is a token of its own
            row, trained, seg = row + [int(y[-1])], trained + [True], seg + seg[-1:]
        for k in sorted(set(seg)):
            at = [t for t in range(len(row)) if seg[t] == k]
            pad = isinstance(ds, Packed) and k == len(ds.rows[i])
            text = f"(padding: {len(at)} tokens)" if pad else \
                marked(tok, [row[t] for t in at], [trained[t] for t in at], ids)
            lines.append(f"   {text}")
    return "\n".join(lines)


def marked(tok: Tokenizer | None, row: list[int], trained: list[bool], ids: bool = False) -> str:
    """row decoded with its special tokens, runs of trained tokens inside [[ ]] (the ids themselves
    without a tokenizer)."""
    out, k = [], 0
    while k < len(row):
        j = k
        while j < len(row) and trained[j] == trained[k]:
            j += 1
        if tok is None:
            text = " ".join(map(str, row[k:j]))
        elif ids:
            text = "".join(f"{tok.decode([i], specials=True)}⟨{i}⟩" for i in row[k:j])
        else:
            text = span_text(tok, row, k, j)
        out.append(f"[[{text}]]" if trained[k] else text)
        k = j
    return ("" if tok is not None else " ").join(out)


def span_text(tok: Tokenizer, row: list[int], a: int, b: int, context: int = 8) -> str:
    """The text of row[a:b] as it reads in the row: the decoding of a few tokens before it and the span,
    less that of the tokens before it (so a word keeps its leading space and a character its bytes)."""
    before = row[max(0, a - context):a]
    whole, head = tok.decode(before + row[a:b], specials=True), tok.decode(before, specials=True)
    return whole[len(head):] if whole.startswith(head) else tok.decode(row[a:b], specials=True)
