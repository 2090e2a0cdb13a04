"""``qwenvl-prep eval --report / --compare`` (issue 43, item 5): bootstrap intervals over records, equal to the
textbook percentile bootstrap of the same draws; the paired difference of two predictions files; the Markdown
report naming what was evaluated."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import save_image

from qwenvl_prep.cli import main

MIN, MAX = 64 * 28 * 28, 256 * 28 * 28
N = 40


@pytest.fixture()
def benchmark(tmp_path):
    """N one-box records, predictions A right on records 0, 2, 5, ... (about 60%) and B right on every fourth."""
    save_image(tmp_path / "raw" / "a.jpg", 640, 480)
    lines = [{"image": "a.jpg", "question": "Where?", "answer": '[{"bbox_2d": [100, 100, 300, 300]}]'}] * N
    (tmp_path / "raw" / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data" / "test.json"
    assert main(["convert", str(tmp_path / "raw" / "in.jsonl"), "-o", str(data), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    label = json.loads(data.read_text())[0]["messages"][1]["content"]
    hits_a = [i % 5 in (0, 2, 3) for i in range(N)]
    hits_b = [i % 4 == 0 for i in range(N)]
    files = []
    for name, hits in (("a", hits_a), ("b", hits_b)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": "p", "label": label,
                                            "predict": label if hit else '[{"bbox_2d": [0, 0, 5, 5]}]'}) + "\n"
                                for hit in hits))
        files.append(path)
    return data, files, np.array(hits_a, float), np.array(hits_b, float)


def textbook(values: np.ndarray, resamples: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    means = [values[rng.choice(np.arange(len(values)), size=len(values))].mean() for _ in range(resamples)]
    return [round(float(np.percentile(means, 2.5)), 4), round(float(np.percentile(means, 97.5)), 4)]


def test_intervals_paired_difference_and_report(benchmark, tmp_path, capsys):
    data, (a, b), hits_a, hits_b = benchmark
    report, out = tmp_path / "report.md", tmp_path / "eval.json"
    capsys.readouterr()
    assert main(["eval", str(data), "--predictions", str(a), "--compare", str(b), "--report", str(report),
                 "--json-out", str(out), "--bootstrap", "400", "--bootstrap-seed", "3"]) == 0
    result = json.loads(out.read_text())
    overall = result["intervals"]["subsets"]["overall"]
    acc = overall["metrics"]["boxes/acc@0.5"]
    assert overall["n"] == N and acc["value"] == result["overall"]["acc@0.5"] == pytest.approx(hits_a.mean())
    assert acc["ci95"] == pytest.approx(textbook(hits_a, 400, 3), abs=1e-4)
    assert acc["ci95"][0] < acc["value"] < acc["ci95"][1]
    paired = overall["paired"]["boxes/acc@0.5"]
    assert paired["difference"] == pytest.approx(hits_a.mean() - hits_b.mean(), abs=1e-4)
    assert paired["ci95"][0] > 0  # A is better on the same records, beyond the draw
    text = report.read_text()
    assert "| overall | 40 | boxes/acc@0.5 |" in text and "Paired difference A - B" in text
    assert "not recorded (not written by qwenvl-prep predict)" in text and str(data) in text


def test_the_same_seed_gives_the_same_intervals_and_outputs_are_guarded(benchmark, tmp_path, capsys):
    data, (a, _), _, _ = benchmark
    runs = []
    for _ in range(2):
        assert main(["eval", str(data), "--predictions", str(a), "--report", str(tmp_path / "r.md"), "--json",
                     "--bootstrap", "50"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["intervals"])
    assert runs[0] == runs[1]
    with pytest.raises(SystemExit):
        main(["eval", str(data), "--predictions", str(a), "--report", str(tmp_path / "r.md"), "--bootstrap",
              "1000000000"])
    assert "must be at most 100000" in capsys.readouterr().err
    assert main(["eval", str(data), "--predictions", str(a), "--report", str(a)]) != 0  # never over an input
    assert json.loads(a.read_text().splitlines()[0])["prompt"] == "p"


HOSTILE = "Output `bbox_2d` JSON <script>alert(1)</script>\n# Forged heading\n| forged | row |\r\n``<img src=x>"


def test_recorded_values_are_rendered_as_text(benchmark, tmp_path, capsys):
    """Issue 51, class 6: a prompt holding a backtick ended its code span and let the rest through as HTML; a
    settings file's preset source with a newline, a heading, a table row or a <script> was carried into the report
    as such. Rendered (CommonMark with tables), every recorded value is text: no HTML element, no heading or table
    row of its own, and still readable."""
    markdown_it = pytest.importorskip("markdown_it")
    data, (a, b), _, _ = benchmark
    preset = {"preset": "refcoco`", "family": "qwen2_5_vl\n# H", "source": HOSTILE, "template": HOSTILE,
              "answer": ["not", "a name"], "system": "s", "prefill": "`"}
    for path, prompt in ((a, preset), (b, HOSTILE)):
        path.with_name(path.name + ".settings.json").write_text(json.dumps(
            {"model_dir": HOSTILE, "policy": {"min_pixels": HOSTILE}, "prompt": prompt, "settings": {}}))
    records = json.loads(data.read_text())
    for k, record in enumerate(records):
        record["meta"] = {"group": HOSTILE if k % 2 else "plain"}
    data.write_text(json.dumps(records))
    report = tmp_path / "report.md"
    assert main(["eval", str(data), "--predictions", str(a), "--compare", str(b), "--report", str(report),
                 "--bootstrap", "20", "--by", "group"]) == 0
    text = report.read_text()
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    assert "<script" not in html and "<img" not in html
    assert html.count("<h1>") == 1 and "<h2>" not in html and [line for line in text.splitlines()
                                                              if line.startswith("#")] == ["# Evaluation report"]
    table_lines = [line for line in text.splitlines() if line.startswith("|")]
    assert html.count("<tr>") == len(table_lines) - 2  # each table's separator line is no row
    for row in html.split("<tr>")[1:]:
        assert row.count("<td>") in (0, 5, 6) and row.count("<th>") in (0, 5, 6), row
    flat = "Output `bbox_2d` JSON &lt;script&gt;alert(1)&lt;/script&gt; # Forged heading | forged | row |"
    assert html.count(flat) >= 6  # model_dir, source and template of A, prompt and model_dir of B, a subset
    assert "<code>refcoco`</code>" in html and "<code>`</code>" in html
