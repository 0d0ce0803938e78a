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
    ("vocab: {real_size: true}", "vocab.real_size: True is a boolean; expected a number"),
    ("cadence: {read_every: false}", "cadence.read_every: False is a boolean; expected a "
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


def _alias_bomb(levels: int) -> str:
    """A YAML "billion laughs": 10**levels strings from a few hundred bytes, under a typed key."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{n}: &l{n} [{','.join([f'*l{n - 1}'] * 10)}]" for n in range(1, levels)]
    return "\n".join([*lines, f"cadence: {{read_every: *l{levels - 1}}}"]) + "\n"


def test_an_alias_bomb_is_a_short_error(tmp_path: Path) -> None:
    # 7 levels wrote a 39 MB message (9 would have been ~3.5 GB); the error quotes what it
    # got within bounds and still names the file and the key.
    p = tmp_path / "bomb.yaml"
    p.write_text(_alias_bomb(7))
    assert p.stat().st_size < 500
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    assert len(str(e.value)) < 2000 and str(p) in str(e.value)
    assert any(x.startswith("cadence.read_every: Input should be a valid integer")
               for x in e.value.problems), e.value.problems


@pytest.mark.parametrize(("name", "content", "problem"), [
    ("latin1.yaml", "run_id: caf\xe9\n".encode("latin-1"),
     "not UTF-8 text: byte 0xe9 at offset 11 is not UTF-8; save the file as UTF-8"),
    ("utf16.yaml", "run_id: r1\n".encode("utf-16"),
     "not UTF-8 text: it is UTF-16 (it starts with a UTF-16 byte-order mark)"),
    ("digits.yaml", b"cadence: {read_every: " + b"1" * 5000 + b"}\n", "not valid YAML: Exceeds"),
    ("digits.json", b'{"cadence": {"read_every": ' + b"1" * 5000 + b"}}", "not valid JSON: "),
    ("digits.toml", b"[cadence]\nread_every = " + b"1" * 5000 + b"\n", "not valid TOML: "),
    ("deep.json", b"[" * 50_000 + b"]" * 50_000, "not a policy: JSON nested too deeply"),
    ("deep.yaml", b"[" * 50_000 + b"]" * 50_000, "not a policy: YAML nested too deeply"),
    ("deep.toml", b"a = " + b"[" * 50_000 + b"]" * 50_000, "not a policy: TOML nested too"),
])
def test_unreadable_files_are_policy_errors_that_name_the_file(
    tmp_path: Path, name: str, content: bytes, problem: str
) -> None:
    # These raised a bare UnicodeDecodeError, ValueError or RecursionError, naming no file.
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    assert e.value.source == str(p) and len(str(e.value)) < 1000
    assert e.value.problems[0].startswith(problem), e.value.problems


def test_a_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"run_id": "r1"}).encode())
    assert load_policy(p).run_id == "r1"


@pytest.mark.parametrize(("text", "problem"), [
    ('checks: {padding_mass: {threshold: "0.5"}}',
     "checks.padding_mass.threshold: '0.5' is a string; expected a number"),
    ('cadence: {read_every: "12"}', "cadence.read_every: '12' is a string; expected a number"),
    ('checks: {padding_mass: {exact: "yes"}}',
     "checks.padding_mass.exact: 'yes' is a string; expected true or false"),
    ("checks: {nonfinite: {localise: 1}}",
     "checks.nonfinite.localise: 1 is an integer; expected true or false"),
])
def test_strings_are_no_numbers_and_no_booleans(tmp_path: Path, text: str, problem: str) -> None:
    # pydantic's lax mode took "12" as 12 and "yes" (or 1) as true.
    p = tmp_path / "guard.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    assert problem in e.value.problems, e.value.problems


def test_the_readme_policy_block_is_a_valid_policy_of_the_defaults() -> None:
    # README.md's policy block is what a user copies: it loads, and it says the defaults (the
    # run_id and the real vocab size are its example's own).
    import re
    from pathlib import Path

    import yaml

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Policy", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    loaded = Policy.model_validate(yaml.safe_load(block[1]))
    defaults = Policy().model_dump()
    stated = loaded.model_dump()
    assert stated["checks"] == defaults["checks"] and stated["cadence"] == defaults["cadence"]
    assert stated["export"] == defaults["export"]
    assert {k: v for k, v in stated["vocab"].items() if k != "real_size"} == \
        {k: v for k, v in defaults["vocab"].items() if k != "real_size"}
