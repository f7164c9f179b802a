"""infhip-export-triton: the config.pbtxt it writes (parsed back), atomic replacement and one-line
errors. The exported model.py, run in-process: test_export_triton_model.py; the real
tritonserver runs it in tests/test_triton_server.py."""

from __future__ import annotations

import re

import pytest

from infhip.errors import BuildError
from infhip.runtime.serving.triton.export import export_triton_repo, main
from infhip.runtime.serving.triton.model import OUTPUTS, PARAMETERS
from tests._fake_triton import engine, parse_pbtxt  # noqa: F401 (engine: a fixture)


def test_config_pbtxt(engine, tmp_path):
    out = export_triton_repo(engine, tmp_path / "repo", model_name="tiny")
    assert out == tmp_path / "repo" / "tiny" and (out / "1" / "model.py").is_file()
    cfg = parse_pbtxt((out / "config.pbtxt").read_text())
    assert cfg["name"] == ["tiny"] and cfg["backend"] == ["python"] and cfg["max_batch_size"] == [0]
    assert cfg["model_transaction_policy"] == [{"decoupled": [True]}]
    assert cfg["instance_group"] == [{"count": [1], "kind": ["KIND_MODEL"]}]
    inputs = {t["name"][0]: (t["data_type"][0], t["dims"], t["optional"][0]) for t in cfg["input"]}
    assert inputs == {"text_input": ("TYPE_STRING", [1], True), "input_ids": ("TYPE_INT32", [-1], True),
                      "stop": ("TYPE_STRING", [-1], True), "stop_token_ids": ("TYPE_INT32", [-1], True)}
    # the scalar fields are request parameters, which config.pbtxt lists in comments
    text = (out / "config.pbtxt").read_text()
    assert [re.search(rf"^#   {name} \((\w+)\)", text, re.M).group(1) for name, *_ in PARAMETERS] == \
        ["int", "number", "number", "int", "bool", "int", "bool"]
    outputs = {t["name"][0]: (t["data_type"][0], t["dims"]) for t in cfg["output"]}
    assert outputs == {name: (dtype, dims) for name, dtype, dims, _ in OUTPUTS}
    assert outputs["text_output"] == ("TYPE_STRING", [1]) and outputs["finish_reason"][0] == "TYPE_STRING"
    params = {p["key"][0]: p["value"][0]["string_value"][0] for p in cfg["parameters"]}
    assert params["engine_dir"] == str(engine.absolute()) and params["max_num_seqs"] == "4"
    assert "device" not in params
    # the engine stays where it is; the model file is this package's template
    assert not (out / "1" / "rank0.safetensors").exists()
    from infhip.runtime.serving.triton import model as triton_model
    assert (out / "1" / "model.py").read_text() == open(triton_model.__file__).read()

    cfg = parse_pbtxt((export_triton_repo(engine, tmp_path / "repo", model_name="tiny2", decoupled=False,
                                          max_batch_size=2, device="cpu") / "config.pbtxt").read_text())
    params = {p["key"][0]: p["value"][0]["string_value"][0] for p in cfg["parameters"]}
    assert cfg["model_transaction_policy"] == [{"decoupled": [False]}]
    assert params["max_num_seqs"] == "2" and params["device"] == "cpu"


def test_default_name_and_quoting(engine, tmp_path):
    odd = tmp_path / 'we"ird\\dir'
    odd.mkdir()
    (odd / "eng").symlink_to(engine, target_is_directory=True)
    out = export_triton_repo(odd / "eng", tmp_path / "repo")
    assert out.name == "eng"  # default: the engine folder's name
    params = {p["key"][0]: p["value"][0]["string_value"][0]
              for p in parse_pbtxt((out / "config.pbtxt").read_text())["parameters"]}
    assert params["engine_dir"] == str(odd / "eng")  # absolute, the link kept


def test_force_and_atomicity(engine, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    out = export_triton_repo(engine, repo, model_name="m")
    (out / "marker").write_text("old")
    with pytest.raises(BuildError, match="already exists; pass --force"):
        export_triton_repo(engine, repo, model_name="m")
    assert (out / "marker").read_text() == "old"

    # a failure while writing leaves the old model untouched and no temporary folder behind
    import infhip.runtime.serving.triton.export as ex

    def broken_copy(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(ex.shutil, "copyfile", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        export_triton_repo(engine, repo, model_name="m", force=True)
    monkeypatch.undo()
    assert (out / "marker").read_text() == "old"
    assert sorted(p.name for p in repo.iterdir()) == ["m"]

    export_triton_repo(engine, repo, model_name="m", force=True)
    assert not (out / "marker").exists() and (out / "config.pbtxt").is_file()
    assert sorted(p.name for p in repo.iterdir()) == ["m"]

    (repo / "notamodel").mkdir()
    (repo / "notamodel" / "data.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not a Triton model folder"):
        export_triton_repo(engine, repo, model_name="notamodel", force=True)
    assert (repo / "notamodel" / "data.txt").read_text() == "keep me"


@pytest.mark.parametrize("kwargs, match", [
    (dict(model_name="bad/name"), "not a valid Triton model name"),
    (dict(model_name=".hidden"), "not a valid Triton model name"),
    (dict(model_name=""), "not a valid Triton model name"),
    (dict(max_batch_size=5), r"in \[1, 4\]"),
    (dict(max_batch_size=0), r"in \[1, 4\]"),
    (dict(device="tpu"), "device must be cpu or cuda"),
])
def test_bad_arguments(engine, tmp_path, kwargs, match):
    with pytest.raises(BuildError, match=match):
        export_triton_repo(engine, tmp_path / "repo", **kwargs)
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


def test_cli(engine, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["--engine", str(engine), "--repo", str(repo), "--model-name", "m"]) == 0
    assert f"tritonserver --model-repository {repo}" in capsys.readouterr().out
    assert main(["--engine", str(engine), "--repo", str(repo), "--model-name", "m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("infhip-export-triton: error:") and "--force" in err
    assert main(["--engine", str(tmp_path / "nothing"), "--repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an infhip engine" in err and "infhip-build" in err
    (tmp_path / "file").write_text("")
    assert main(["--engine", str(engine), "--repo", str(tmp_path / "file")]) == 1
    assert "is not a directory" in capsys.readouterr().err
