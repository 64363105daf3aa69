"""Phantom writes only what it owns: nothing through a planted link, nothing into a folder that is not
its run's (nothing of the user's deleted), and --resume only from this run's own sealed checkpoint.

Each case runs the scripts in process on the tiny model and checks, besides the one `error:` line and
exit 2, that every file the test made (inside the folder given and beside it) is byte for byte as it
was: `snapshot` before, `snapshot` after.
"""
from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
import torch

from phantom.base import fileio
from phantom.files import runfolder, seal
from phantom.files.store import BlockStore
from test_convert import load_script
from test_faults import env, finetune, weights  # noqa: F401 (the tiny store's CLI fixtures)

RUN = ["--iters", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--val-split", "0", "-q",
       "--prefetch", "1", "--offload", "disk"]


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict:
    """rel -> bytes (a link: 'link -> target') of everything under root but the names in skip."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.name in skip:
            continue
        rel = path.relative_to(root).as_posix()
        found[rel] = f"link -> {os.readlink(path)}" if path.is_symlink() else \
            path.read_bytes() if path.is_file() else "dir"
    return found


def one_line(capsys, code: int, *words: str) -> str:
    err = capsys.readouterr().err  # a resumed copy may warn first that its --out differs from the recorded one
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("error: ") and "Traceback" not in err, err
    assert sum(line.startswith("error") for line in lines) == 1 and all(w in lines[-1] for w in words), err
    return lines[-1]


@pytest.fixture(scope="module")
def runs(weights, tmp_path_factory):
    """Run A (into a folder reached through a link: the user's choice, allowed), run B (another seed and
    lr) and run R4 (LoRA rank 4), 3 steps each, through the script."""
    root = tmp_path_factory.mktemp("runs")
    (root / "real").mkdir()
    (root / "A").symlink_to(root / "real")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHANTOM_WEIGHTS", str(weights))
        for name, extra in (("A", []), ("B", ["--seed", "1", "--lr", "5e-3"]), ("R4", ["--lora-rank", "4"])):
            assert finetune(*RUN, *extra, "--out", root / name) == 0, name
    return root


def copy_run(runs: Path, tmp_path: Path, name: str = "A") -> Path:
    return Path(shutil.copytree(runs / name, tmp_path / name, symlinks=True))


# -- 1. nothing written through a link ----------------------------------------------------------------

def test_a_lock_planted_as_a_link_is_refused(env, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "v").write_text("X\n")
    (tmp_path / "o" / ".lock").symlink_to("../v")
    before = snapshot(tmp_path)
    one_line(capsys, finetune(*RUN, "--out", tmp_path / "o"), f"{tmp_path / 'o' / '.lock'} is a symbolic link")
    assert snapshot(tmp_path) == before


def test_a_temporary_name_planted_as_a_link_is_refused(env, tmp_path, capsys):
    (tmp_path / "o2" / "adapter").mkdir(parents=True)
    (tmp_path / "v2").write_text("Y\n")
    planted = tmp_path / "o2" / "adapter" / ".adapter_model.safetensors.tmp"
    planted.symlink_to("../../v2")
    before = snapshot(tmp_path)
    one_line(capsys, finetune(*RUN, "--out", tmp_path / "o2"), f"{planted} is a symbolic link")
    assert snapshot(tmp_path) == before


def test_a_link_inside_the_run_s_own_folder_is_refused_on_resume(runs, env, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    (tmp_path / "v").write_text("X\n")
    (out / "adapter" / "adapter_config.json").unlink()
    (out / "adapter" / "adapter_config.json").symlink_to(tmp_path / "v")
    before = snapshot(tmp_path, skip=(".lock",))
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), "adapter_config.json is a symbolic link")
    assert snapshot(tmp_path, skip=(".lock",)) == before


def test_replacing_unlinks_a_planted_temporary_and_never_follows_it(tmp_path):
    victim = tmp_path / "v2"
    victim.write_bytes(b"user's")
    (tmp_path / ".f.bin.tmp").symlink_to(victim)
    with fileio.replacing(tmp_path / "f.bin") as tmp:
        tmp.write_bytes(b"phantom's")
    assert victim.read_bytes() == b"user's"
    assert not (tmp_path / "f.bin").is_symlink() and (tmp_path / "f.bin").read_bytes() == b"phantom's"


@pytest.mark.parametrize("writer", ["atomic_write", "replacing", "locked", "RecordLog"])
def test_no_writer_goes_through_a_link_at_its_name(tmp_path, writer):
    victim = tmp_path / "v"
    victim.write_bytes(b"user's")
    path = tmp_path / "f"
    path.symlink_to(victim)
    with pytest.raises(fileio.LinkError, match="is a symbolic link"):
        if writer == "atomic_write":
            fileio.atomic_write(path, b"x")
        elif writer == "replacing":
            with fileio.replacing(path):
                pass
        elif writer == "locked":
            with fileio.locked(path, wait=False):
                pass
        else:
            fileio.RecordLog(path)
    assert victim.read_bytes() == b"user's" and path.is_symlink()


@pytest.mark.parametrize("writer", ["locked", "RecordLog"])
def test_files_written_in_place_refuse_a_hard_link(tmp_path, writer):
    """A lock and an append-only log are written in place: a hard link to a user's file is refused."""
    victim = tmp_path / "v"
    victim.write_bytes(b"user's")
    os.link(victim, tmp_path / "f")
    with pytest.raises(fileio.LinkError, match="hard link"):
        if writer == "locked":
            with fileio.locked(tmp_path / "f", wait=False):
                pass
        else:
            fileio.RecordLog(tmp_path / "f")
    assert victim.read_bytes() == b"user's"


# -- 2. a run writes only into a folder that is its own ------------------------------------------------

def users_folder(root: Path) -> Path:
    u = root / "u"
    for rel in ("README.md", "config.yaml", "metrics.jsonl", "checkpoint/x", "store/x", "optim/x"):
        (u / rel).parent.mkdir(parents=True, exist_ok=True)
        (u / rel).write_text(f"the user's {rel}\n")
    return u


@pytest.mark.parametrize("mode", [[], ["--mode", "full", "--lr", "1e-3"]], ids=["lora", "full"])
def test_a_folder_that_is_not_a_run_is_refused_listing_what_it_holds(env, tmp_path, capsys, mode):
    u = users_folder(tmp_path)
    before = snapshot(tmp_path)
    one_line(capsys, finetune(*RUN, *mode, "--out", u), "is not a phantom run folder",
             "README.md, checkpoint/, config.yaml, metrics.jsonl, optim/, store/")
    assert snapshot(tmp_path) == before


def test_another_run_s_folder_is_refused_without_overwrite(runs, env, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    before = snapshot(tmp_path)
    one_line(capsys, finetune(*RUN, "--out", out), "holds another phantom run", "--overwrite")
    assert snapshot(tmp_path) == before
    one_line(capsys, finetune(*RUN, "--out", out, "--resume", "--overwrite"), "choose one")


def test_a_run_stopped_before_its_first_checkpoint_may_start_again(tmp_path):
    """Nothing to keep (a full disk before the first checkpoint): the same command runs again as it is;
    once the folder holds a checkpoint, it takes --resume or --overwrite."""
    out = tmp_path / "o"
    with runfolder.claimed(out) as marker:
        (out / "config.yaml").write_text("run: 1\n")
    assert runfolder.check(out, resume=False, overwrite=False, mode="lora") == marker
    (out / "checkpoint").mkdir()
    with pytest.raises(runfolder.RunFolderError, match="holds another phantom run"):
        runfolder.check(out, resume=False, overwrite=False, mode="lora")


def test_overwrite_replaces_phantom_s_files_and_keeps_the_user_s(runs, env, tmp_path):
    out = copy_run(runs, tmp_path)
    (out / "notes.txt").write_text("mine\n")
    (out / "adapter" / "mine.txt").write_text("mine too\n")
    old = runfolder.run_id(out)
    assert finetune(*RUN, "--out", out, "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "adapter" / "mine.txt").read_text() == "mine too\n"
    new = runfolder.run_id(out)
    assert new != old and seal.read_seal(out / "checkpoint")["run"] == new


def test_overwrite_in_full_mode_keeps_a_store_a_full_run_did_not_make(runs, env, tmp_path, capsys):
    out = copy_run(runs, tmp_path)  # a LoRA run's folder, into which the user put store/
    (out / "store").mkdir()
    (out / "store" / "x").write_text("the user's\n")
    before = snapshot(tmp_path, skip=(".lock",))
    one_line(capsys, finetune(*RUN, "--mode", "full", "--lr", "1e-3", "--out", out, "--overwrite"),
             f"{out / 'store'} was not written by a full finetune run")
    assert snapshot(tmp_path, skip=(".lock",)) == before


@pytest.mark.parametrize("script, kind", [("prepare_model", "store"), ("merge_lora", "export")])
def test_overwrite_on_a_folder_phantom_did_not_write_deletes_nothing(env, tmp_path, capsys, script, kind):
    u = users_folder(tmp_path)
    argv = ["--synthetic", "--layers", "1"] if script == "prepare_model" else ["--model", str(env / "tiny")]
    before = snapshot(tmp_path)
    one_line(capsys, load_script(script).main([*argv, "--out", str(u), "--overwrite", "--quiet"]),
             f"{u} is not a phantom {kind}", "README.md, checkpoint/")
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_a_phantom_store_and_export(env, tmp_path):
    store, export = tmp_path / "store", tmp_path / "export"
    prepare, merge = load_script("prepare_model").main, load_script("merge_lora").main
    for _ in range(2):  # the second time over what the first wrote
        assert prepare(["--synthetic", "--layers", "1", "--out", str(store), "--overwrite", "--quiet"]) == 0
        assert merge(["--model", str(store), "--out", str(export), "--overwrite", "--quiet"]) == 0
    BlockStore(store, verify="full")
    assert runfolder.folder_kind(store) == "store" and runfolder.folder_kind(export) == "export"


# -- 4. --resume only from this run's own checkpoint ------------------------------------------------------

def pickled_state(path: Path, marker: Path) -> None:
    """A state.pt whose pickle would create `marker` if it were unpickled without weights_only."""
    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    buf = io.BytesIO()
    torch.save({"step": 3, "optimizer": Payload()}, buf)
    path.write_bytes(buf.getvalue())


TAMPERED = {  # name -> how checkpoint/ of a copy of run A is changed, and the file the refusal names
    "state.pt of run B": (lambda r, c: shutil.copy(r / "B" / "checkpoint" / "state.pt", c), "state.pt"),
    "trainable of run B": (lambda r, c: shutil.copy(r / "B" / "checkpoint" / "trainable.safetensors", c),
                           "trainable.safetensors"),
    "state.pt of a rank-4 run": (lambda r, c: shutil.copy(r / "R4" / "checkpoint" / "state.pt", c), "state.pt"),
    "truncated state.pt": (lambda r, c: os.truncate(c / "state.pt", 100), "state.pt"),
    "pickled state.pt": (lambda r, c: pickled_state(c / "state.pt", r / "EXECUTED"), "state.pt"),
    "a file added": (lambda r, c: (c / "extra.bin").write_bytes(b"x"), "extra.bin"),
    "a file removed": (lambda r, c: (c / "adapter" / "adapter_config.json").unlink(), "adapter/adapter_config.json"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_checkpoint_is_refused_naming_the_file(runs, env, tmp_path, capsys, case):
    out = copy_run(runs, tmp_path)
    change, name = TAMPERED[case]
    change(runs, out / "checkpoint")
    before = snapshot(tmp_path, skip=(".lock",))
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), f"{out / 'checkpoint' / name}")
    assert snapshot(tmp_path, skip=(".lock",)) == before and not (runs / "EXECUTED").exists()


def test_another_run_s_whole_checkpoint_is_refused(runs, env, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    shutil.rmtree(out / "checkpoint")
    shutil.copytree(runs / "B" / "checkpoint", out / "checkpoint")
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), "was written by another run")


def test_a_checkpoint_without_a_seal_is_refused(runs, env, tmp_path, capsys):
    """A checkpoint of an older phantom (no manifest.json) cannot be checked: refused, start again."""
    out = copy_run(runs, tmp_path)
    (out / "checkpoint" / seal.SEAL).unlink()
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), "has no manifest.json",
             "start the run again")


def test_an_older_run_folder_is_refused_on_resume(runs, env, tmp_path, capsys):
    """A run folder of an older phantom (no phantom-run.json) is not known to be a run's: refused."""
    out = copy_run(runs, tmp_path)
    (out / runfolder.MARKER).unlink()
    before = snapshot(tmp_path)
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), "is not a phantom run folder",
             "older phantom", "start it again")
    assert snapshot(tmp_path) == before


FORGED = ["state.pt of a rank-4 run", "truncated state.pt", "pickled state.pt"]


@pytest.mark.parametrize("case", FORGED)
def test_a_bad_state_under_a_forged_seal_is_still_one_line(runs, env, tmp_path, capsys, case):
    """The seal re-written over the bad file (a determined hand): the state is still read with
    weights_only and checked against the optimizer, and refused with one line naming state.pt."""
    out = copy_run(runs, tmp_path)
    TAMPERED[case][0](runs, out / "checkpoint")
    seal.write_seal(out / "checkpoint", runfolder.run_id(out), step=3)
    one_line(capsys, finetune(*RUN, "--iters", "4", "--resume", "--out", out), str(out / "checkpoint" / "state.pt"))
    assert not (runs / "EXECUTED").exists()


def test_an_honest_resume_passes_the_seal(runs, env, tmp_path):
    out = copy_run(runs, tmp_path)
    assert finetune(*RUN, "--iters", "4", "--resume", "--out", out) == 0
    assert seal.check_seal(out / "checkpoint", runfolder.run_id(out))["step"] == 4
