"""Issue 51, class 4: where predict (and every command) writes. An output path that is a named pipe, a socket or a
device is refused before anything loads, as folders and links are; a kill between the steps that finish a resumable
output leaves a state the next run finishes; a folder the engine would stop on is refused before it starts, leaving
nothing."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
from helpers import save_image
from hostile import POLICY, RECORD

from qwenvl_prep.cli import main
from qwenvl_prep.plumbing.outputs import UnsafeOutput, check_output
from qwenvl_prep.plumbing.resumable import ResumableOutput

SETTINGS = {"model_dir": "m", "settings": {"seed": 0}}
ROWS = [{"row": k} for k in range(6)]


def refused(capsys, args: list, *expected: str) -> str:
    assert main([str(a) for a in args]) == 2, args
    err = capsys.readouterr().err
    assert all(text in err for text in expected) and "Traceback" not in err, (args, err)
    return err


def test_predict_refuses_a_pipe_at_any_of_its_output_paths(tmp_path, capsys):
    """Was: `-o` a FIFO gave rc 0 and the pipe was replaced by a regular file (its reader blocked forever);
    OUTPUT.partial a FIFO loaded the model, then 'File or stream is not seekable' without a path. The model folder
    here is empty: the refusal comes before anything loads."""
    model = tmp_path / "model"
    model.mkdir()
    image = save_image(tmp_path / "i.jpg", 64, 48)
    out = tmp_path / "p.jsonl"
    for name in ("p.jsonl", "p.jsonl.partial", "p.jsonl.partial.settings.json", "p.jsonl.settings.json"):
        os.mkfifo(tmp_path / name)
        refused(capsys, ["predict", model, image, "--prompt", "p", "-o", out], str(tmp_path / name), "a FIFO",
                "not a regular file")
        assert Path(tmp_path / name).is_fifo()
        os.unlink(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.jpg", "model"]


def test_every_command_refuses_outputs_that_are_not_regular_files(tmp_path, capsys):
    """The one output check (``plumbing.outputs``) refuses FIFOs and sockets for every command: convert's -o and
    its registry, eval's --report and --json-out; draw's, demo's and tiny-model's folders."""
    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(RECORD) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    flags = ["--input-coords", "abs", "-q", "--min-pixels", str(POLICY.min_pixels), "--max-pixels",
             str(POLICY.max_pixels)]
    os.mkfifo(data / "t.json")
    refused(capsys, ["convert", src, "-o", data / "t.json", *flags], "t.json is a FIFO")
    os.unlink(data / "t.json")
    os.mkfifo(data / "dataset_info.json")
    refused(capsys, ["convert", src, "-o", data / "t.json", *flags], "dataset_info.json is a FIFO")
    os.unlink(data / "dataset_info.json")
    assert main(["convert", str(src), "-o", str(data / "t.json"), *flags]) == 0
    predictions = tmp_path / "pred.jsonl"
    predictions.write_text(json.dumps({"predict": "[]"}) + "\n")
    os.mkfifo(tmp_path / "r.md")
    refused(capsys, ["eval", data / "t.json", "--predictions", predictions, "--report", tmp_path / "r.md"],
            "--report", "is a FIFO")
    short = Path(f"/tmp/qwenvl-{os.getpid()}.sock")  # a socket path must be short
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(short))
        try:
            with pytest.raises(UnsafeOutput, match="is a socket, not a regular file"):
                check_output(short, "--json-out")
        finally:
            short.unlink()
    assert Path(tmp_path / "r.md").is_fifo()
    # commands that write a folder: a FIFO (or a file) where the folder should be is named as what it is
    os.mkfifo(tmp_path / "drawings")
    refused(capsys, ["draw", data / "t.json", "-o", tmp_path / "drawings"], "drawings is a FIFO, not a folder")
    refused(capsys, ["demo", tmp_path / "drawings"], "drawings is a FIFO, not a folder")
    refused(capsys, ["tiny-model", predictions], "pred.jsonl is a file, not a folder")
    assert Path(tmp_path / "drawings").is_fifo() and predictions.read_text() == json.dumps({"predict": "[]"}) + "\n"


class Killed(BaseException):
    """A kill at a given step of the finish (nothing after it runs)."""


def finish_killed_after(out: Path, steps: int, monkeypatch) -> None:
    """Run an output to its end, killed after ``steps`` file operations of its finish (removals and renames)."""
    done = [0]

    def step(real):
        def wrapped(*args, **kwargs):
            if done[0] == steps:
                raise Killed
            done[0] += 1
            return real(*args, **kwargs)
        return wrapped

    with pytest.raises(Killed), ResumableOutput(out, SETTINGS, batch=2) as first:
        for k in range(0, len(ROWS), 2):
            first.append(ROWS[k:k + 2])
        monkeypatch.setattr(os, "replace", step(os.replace))
        monkeypatch.setattr(Path, "unlink", step(Path.unlink))
    monkeypatch.undo()


@pytest.mark.parametrize("steps", range(4))
def test_a_kill_inside_the_finish_leaves_what_the_next_run_finishes(tmp_path, monkeypatch, steps):
    """Was: killed between the two renames, the relaunch refused, advising to delete every finished row. After each
    step of the finish the files are a state the relaunch finishes (with nothing to answer again), and an OUTPUT
    present never stands beside settings other than its own."""
    out = tmp_path / "p.jsonl"
    settings = out.with_name(out.name + ".settings.json")
    out.write_text('{"old": 1}\n')  # a finished earlier run of other settings
    settings.write_text(json.dumps({"model_dir": "old"}))
    finish_killed_after(out, steps, monkeypatch)
    if out.exists():  # the old output, beside its own settings or none
        assert out.read_text() == '{"old": 1}\n'
        assert not settings.exists() or json.loads(settings.read_text()) == {"model_dir": "old"}
    with ResumableOutput(out, SETTINGS, batch=2) as again:
        assert again.done == len(ROWS)
    assert [json.loads(line) for line in out.read_text().splitlines()] == ROWS
    assert json.loads(settings.read_text()) == SETTINGS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "p.jsonl.settings.json"]


def test_rows_whose_settings_wait_at_the_final_name_are_refused_for_other_settings(tmp_path, monkeypatch):
    """The same state resumed with other settings is refused naming where the rows' settings are; nothing moves."""
    out = tmp_path / "p.jsonl"
    finish_killed_after(out, 3, monkeypatch)  # after the settings. rename
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"settings\.seed differ: .*p\.jsonl\.settings\.json has them"):
        with ResumableOutput(out, {**SETTINGS, "settings": {"seed": 1}}, batch=2):
            pass
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_folder_without_a_chat_template_is_refused_before_anything_loads(tiny_model, tmp_path, backend):
    """Was: --backend vllm started the engine (a minute), then failed at the first prompt, leaving an empty
    OUTPUT.partial and its settings; the HF backend loaded the weights first. Refused before vLLM is imported."""
    from qwenvl_prep.commands.predict import predictor_for

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink()
    args = type("Args", (), {"backend": backend, "model_dir": model, "max_new_tokens": 4, "temperature": 0.0,
                             "seed": 0, "tensor_parallel_size": 1})()
    with pytest.raises(ValueError, match="has no chat template for its processor"):
        predictor_for(args)


def test_what_vllm_would_stop_on_is_found_in_the_folder(tiny_model, tmp_path):
    """The vLLM backend's folder check: no weights, and a reader rule of the installed vLLM (a missing config);
    the text config's architectures, which predict names for the engine itself, are not a problem."""
    from qwenvl_prep.pipeline.predict_vllm import engine_problems

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert engine_problems(model) == []
    config = json.loads((model / "config.json").read_text())
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("architectures", None)
        (model / "config.json").write_text(json.dumps(config))
        assert engine_problems(model) == []
    (model / "model.safetensors").unlink()
    assert any("no weights" in line for line in engine_problems(model))
    (model / "config.json").unlink()
    assert any("config.json: missing" in line for line in engine_problems(model))


def test_inputs_stored_rotated_are_named_once(tmp_path, capsys):
    """Issue 51's review, class 3 in predict: a phone photo (EXIF orientation) or clip (display matrix) given
    directly was answered in its stored pixels without a word; one warning now names how many and the first."""
    from helpers import set_display_matrix, set_display_rotation, write_clip
    from PIL import Image

    from qwenvl_prep.commands.predict import warn_stored_turned

    photo = Image.new("RGB", (80, 40))
    exif = photo.getexif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise
    photo.save(tmp_path / "phone.jpg", exif=exif)
    Image.new("RGB", (80, 40)).save(tmp_path / "plain.jpg")
    clips = [set_display_rotation(write_clip(tmp_path / "portrait.mp4", 1, 10, 96, 64), 90),
             set_display_matrix(write_clip(tmp_path / "selfie.mp4", 1, 10, 96, 64), -1, 0, 0, 1)]
    warn_stored_turned([str(tmp_path / "plain.jpg"), str(tmp_path / "phone.jpg"), *map(str, clips),
                        str(tmp_path / "missing.jpg")])
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "3 input(s) are stored rotated or mirrored" in err
    assert f"first {tmp_path / 'phone.jpg'} (EXIF orientation 6)" in err
    warn_stored_turned([str(tmp_path / "plain.jpg")])
    assert capsys.readouterr().err == ""
