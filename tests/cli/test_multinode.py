"""Multi-node runs check their storage: two "nodes" of one process each (LF's torchrun launcher with NNODES=2 on
127.0.0.1). With a separate output_dir per node (what separate local disks look like) both nodes stop before any
step with one message naming output_dir; with one shared output_dir they train, and the check leaves no file."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from helpers import BIN, free_port, grounding_record, save_image, train_config, write_sharegpt


def launch_two_nodes(tiny_model, data_dir, outputs, workdir):
    """Both nodes' ``llamafactory-cli train`` at once (node 0 is the master); their exit codes and logs."""
    port = str(free_port())
    procs = []
    for node, output in enumerate(outputs):
        config = train_config(tiny_model, data_dir, output, max_steps=1, save_steps=1, ddp_backend="gloo")
        path = workdir / f"node{node}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "FORCE_TORCHRUN": "1", "NNODES": "2", "NODE_RANK": str(node), "NPROC_PER_NODE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        procs.append(subprocess.Popen([str(BIN / "llamafactory-cli"), "train", str(path)], cwd=workdir, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    return [proc.returncode for proc in procs], logs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("multinode") / "data"
    write_sharegpt(data, "toy", [grounding_record(save_image(data / f"m{i}.jpg", 640, 480)) for i in range(4)])
    return data


@pytest.mark.slow
def test_separate_output_dirs_stop_every_node_before_any_step(tiny_model, data_dir, tmp_path):
    outputs = [tmp_path / "node0-disk" / "run", tmp_path / "node1-disk" / "run"]
    codes, logs = launch_two_nodes(tiny_model, data_dir, outputs, tmp_path)
    assert codes[0] != 0 and codes[1] != 0, logs
    for log in logs:
        assert "is not one folder for every node" in log and "rank 1 on" in log, log[-3000:]
    assert str(outputs[0]) in logs[0] and str(outputs[1]) in logs[1]
    assert not any((output / "trainer_log.jsonl").exists() for output in outputs)
    assert not list(outputs[0].glob(".qwenvl_shared_output_dir.*"))


@pytest.mark.slow
def test_one_shared_output_dir_trains_on_two_nodes(tiny_model, data_dir, tmp_path):
    output = tmp_path / "shared" / "run"
    codes, logs = launch_two_nodes(tiny_model, data_dir, [output, output], tmp_path)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert (output / "trainer_log.jsonl").exists() and (output / "adapter_model.safetensors").exists()
    assert not list(output.glob(".qwenvl_shared_output_dir.*"))
