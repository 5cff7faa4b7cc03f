import pytest

from eagleops.pipeline.config import ConfigError, format_tokens, load_run, parse_tokens


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10M", 10_000_000),
        ("500k", 500_000),
        ("12000", 12000),
        (12000, 12000),
        ("1.5G", 1_500_000_000),
        ("2_000", 2000),
        ("0", 0),
        ("3m", 3_000_000),
    ],
)
def test_parse_tokens(text, expected):
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("text", ["ten", "-5", "1.2345k", "", "5 tokens", True, 1.5])
def test_parse_tokens_rejects(text):
    with pytest.raises(ValueError):
        parse_tokens(text)


def test_format_tokens():
    assert format_tokens(950) == "950"
    assert format_tokens(12_300) == "12.3k"
    assert format_tokens(10_000_000) == "10M"
    assert format_tokens(123_456_789) == "123M"


def _write(tmp_path, body):
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


BASE = """
[[endpoints]]
base_url = "http://127.0.0.1:30000/v1"
model = "m"
api_key_env = "MY_KEY"
"""


def test_loads_a_full_run_file(tmp_path):
    path = _write(
        tmp_path,
        BASE
        + """
[sampling]
max_tokens = 1024
temperature = 0
[[datasets]]
name = "B1"
path = "data/a.jsonl"
token_budget = "10M"
max_samples = 5
""",
    )
    config = load_run(path)
    assert config.datasets[0].token_budget == 10_000_000
    assert config.datasets[0].path == tmp_path / "data" / "a.jsonl"
    assert config.sampling.temperature == 0.0
    assert config.endpoints[0].api_key_env == "MY_KEY"


@pytest.mark.parametrize(
    "extra,needle",
    [
        ('[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = "lots"\n', "datasets[0].token_budget: not a token count"),
        (
            '[[datasets]]\nname = "B1"\npath = "a"\ntokn_budget = 5\ntoken_budget = 5\n',
            "datasets[0].tokn_budget: unknown key (did you mean 'token_budget'?)",
        ),
        ('[[datasets]]\nname = "B1"\npath = "a"\n', "datasets[0].token_budget: missing"),
        ('[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\nformat = "csv"\n', "datasets[0].format: must be one of"),
        ('concurrency = 0\n[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n', "concurrency: must be at least 1"),
        (
            '[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[[datasets]]\nname = "B1"\npath = "b"\ntoken_budget = 5\n',
            "datasets[1].name: duplicate",
        ),
        (
            '[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[sampling]\nextra = { stream = true }\n',
            "sampling.extra: `stream` is not an extra field (replies are read whole)",
        ),
        (
            '[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[sampling]\nextra = { n = 2, top_k = 5 }\n',
            "sampling.extra: `n` is not an extra field",
        ),
        ('[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[serve]\ncpus = "3-1"\n', "serve.cpus: must list cores like 1-3,6"),
        ('[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[serve]\ncpus = "one"\n', "serve.cpus: must list cores like 1-3,6"),
        (
            '[[datasets]]\nname = "B1"\npath = "a"\ntoken_budget = 5\n[sampling]\nextra = { chat_template_kwargs = "off" }\n',
            "sampling.extra: `chat_template_kwargs` must be a table",
        ),
    ],
)
def test_errors_name_the_key(tmp_path, extra, needle):
    # top-level keys must come before the tables in TOML
    top, _, rest = extra.partition("[[datasets]]")
    path = _write(tmp_path, top + BASE + "[[datasets]]" + rest)
    with pytest.raises(ConfigError) as err:
        load_run(path)
    assert str(path) in str(err.value)
    assert needle in str(err.value)


def test_a_key_in_the_run_file_is_refused(tmp_path):
    path = _write(
        tmp_path,
        '[[endpoints]]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\napi_key = "sk-123"\n[[datasets]]\nname = "a"\npath = "a"\ntoken_budget = 1\n',
    )
    with pytest.raises(ConfigError, match=r"endpoints\[0\]\.api_key: keys never go in run files"):
        load_run(path)


def test_invalid_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "this is = = not toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_run(path)
