from __future__ import annotations

import json
from pathlib import Path

import pytest

import guard
from guard import PolicyError, load_policy
from guard.policy import Policy

YAML = """\
run_id: gpt-small-001
vocab:
  real_size: 50257
  pad_multiple: 64
  tensor_parallel: 1
checks:
  alignment:    {action: fail}
  vocab:        {action: fail}
  padding_mass: {action: mask, threshold: 1.0e-6, sample_tokens: 256}
  nonfinite:    {action: fail}
  token_range:  {action: fail, ignore_index: -100}
  loss_spike:   {action: warn, factor: 10.0, window: 100}
cadence:
  read_every: 1
export:
  serve: 127.0.0.1:9464
  push: null
"""

TOML = """\
run_id = "gpt-small-001"
[vocab]
real_size = 50257
[checks.padding_mass]
action = "mask"
threshold = 1.0e-6
[checks.nonfinite]
action = "fail"
[export]
serve = "127.0.0.1:9464"
"""


def test_design_example_in_three_formats(tmp_path: Path) -> None:
    y = tmp_path / "p.yaml"
    y.write_text(YAML)
    t = tmp_path / "p.toml"
    t.write_text(TOML)
    j = tmp_path / "p.json"
    j.write_text(json.dumps(load_policy(y).model_dump()))
    py, pt, pj = load_policy(y), load_policy(t), load_policy(j)
    assert py == pj
    assert py.run_id == pt.run_id == "gpt-small-001"
    assert py.vocab.real_size == pt.vocab.real_size == 50257
    assert py.checks == Policy(checks=py.checks).checks


def test_defaults_match_design() -> None:
    p = Policy()
    assert [p.action(c) for c in ("alignment", "vocab", "padding_mass", "nonfinite",
                                  "token_range", "loss_spike")] == \
        ["fail", "fail", "mask", "fail", "fail", "warn"]
    assert p.checks.padding_mass.threshold is None and p.checks.padding_mass.excess == 10.0
    assert p.checks.padding_mass.sample_tokens == 256
    assert p.checks.token_range.ignore_index == -100
    assert (p.checks.loss_spike.factor, p.checks.loss_spike.window) == (10.0, 100)
    assert p.cadence.read_every == 1 and p.vocab.pad_multiple == 64
    assert p.export.serve == "127.0.0.1:9464" and p.export.push is None


def test_empty_yaml_is_the_defaults(tmp_path: Path) -> None:
    f = tmp_path / "empty.yml"
    f.write_text("")
    assert load_policy(f) == Policy()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("checks:\n  nonfinite: {action: mask}\n",
         "checks.nonfinite.action: 'mask' is not allowed; choose fail, skip, warn or off"),
        ("checks:\n  nonfinit: {action: warn}\n",
         "checks.nonfinit: unknown key; allowed keys: alignment, vocab, padding_mass"),
        ("chekcs: {}\n", "chekcs: unknown key; allowed keys: run_id, vocab, checks"),
        ("checks:\n  padding_mass: {threshold: 2}\n", "checks.padding_mass.threshold"),
        ("vocab: {pad_multiple: 0}\n", "vocab.pad_multiple"),
        ("cadence: {read_every: two}\n", "cadence.read_every"),
        ("export: {serve: 'localhost'}\n", "export.serve: expected host:port"),
        ("export: {push: 'guard-server:9400'}\n", "export.push: expected an http(s) URL"),
        # re.match's `$` took a trailing newline
        ('export: {push: "http://guard-server:9400\\n"}\n', "export.push: expected an http(s)"),
        ('export: {serve: "127.0.0.1:9464\\n"}\n', "export.serve: expected host:port"),
        ("run_id: 'has space'\n", "run_id"),
        ("- a\n- b\n", "expected a mapping"),
        ("checks: [\n", "not valid YAML"),
    ],
)
def test_bad_files_name_file_key_and_allowed(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(f)
    assert str(f) in str(e.value)
    assert expected in str(e.value)
    assert e.value.source == str(f) and e.value.problems


def test_bad_toml_json_and_extension(tmp_path: Path) -> None:
    for name, text, expected in [("p.toml", "[checks\n", "not valid TOML"),
                                 ("p.json", "{", "not valid JSON"),
                                 ("p.ini", "", "unknown extension '.ini'"),
                                 ("missing.yaml", None, "cannot read")]:
        f = tmp_path / name
        if text is not None:
            f.write_text(text)
        with pytest.raises(PolicyError, match=expected):
            load_policy(f)


def test_policy_error_is_a_value_error_and_a_guard_error() -> None:
    with pytest.raises(ValueError):
        load_policy({"checks": {"vocab": {"action": "mask"}}})
    with pytest.raises(guard.GuardError, match="<dict>"):
        load_policy({"nope": 1})
    with pytest.raises(PolicyError, match="must be a Policy, dict or path"):
        load_policy(42)  # type: ignore[arg-type]


def test_serve_address_adds_local_rank() -> None:
    p = Policy(export={"serve": "0.0.0.0:9464"})
    assert p.export.serve_address(3) == ("0.0.0.0", 9467)
    assert Policy(export={"serve": None}).export.serve_address() is None


def test_yaml_off_is_off_however_yaml_reads_it(tmp_path: Path) -> None:
    p = tmp_path / "guard.yaml"
    p.write_text("checks:\n  padding_mass: {action: off}\n  token_range: {action: no}\n")
    pol = load_policy(p)
    assert pol.action("padding_mass") == "off" and pol.action("token_range") == "off"


@pytest.mark.parametrize(("text", "problem"), [
    ("checks: {loss_spike: {factor: .inf}}", "checks.loss_spike.factor: Input should be a "
                                             "finite number"),
    ("checks: {loss_spike: {min_delta: .nan}}", "checks.loss_spike.min_delta: Input should be "
                                                "a finite number"),
    ("vocab: {real_size: true}", "vocab: real_size: True is a boolean; expected a number"),
    ("cadence: {read_every: false}", "cadence: read_every: False is a boolean; expected a "
                                     "number"),
    ("checks: {padding_mass: {action: on}}", "checks.padding_mass.action: True is not allowed"),
])
def test_non_finite_and_boolean_numbers_are_refused_by_key(tmp_path: Path, text: str,
                                                          problem: str) -> None:
    p = tmp_path / "guard.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    assert any(x.startswith(problem) for x in e.value.problems), e.value.problems
    assert str(p) in str(e.value)
