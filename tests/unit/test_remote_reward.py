"""Rewards served over HTTP against real servers on 127.0.0.1: the reference server gives
the package's own scores, in the order sent, over either image format; metadata arrives
unchanged; retries (and a server's Retry-After), the deadline of a whole request, bad
answers, redirects and the token are each one sentence or the documented behaviour; the
config's settings are checked in one sentence each, every value quoted short and a URL's
password never."""

import email.utils
import json
import sys
import time

import ml_collections
import numpy as np
import pytest
from remote_servers import json_answer, load, reference, scripted, settings, trickling

from tree_grpo_jax import config as cfg
from tree_grpo_jax import rewards
from tree_grpo_jax.rewards import families, remote, serve
from tree_grpo_jax.rewards.base import RewardUnavailable

IMAGES = np.random.default_rng(0).uniform(size=(7, 24, 24, 3)).astype(np.float32)
PROMPTS = [f"p{i}" for i in range(7)]


@pytest.fixture(scope="module")
def jpeg_server():
    with reference("--reward=jpeg_compressibility") as url:
        yield url


@pytest.mark.parametrize("fmt", remote.FORMATS)
def test_remote_scores_equal_the_local_reward(jpeg_server, fmt):
    reward = load(f"{jpeg_server}/score", format=fmt, batch_size=3, in_flight=2)
    local = rewards.get_reward("jpeg_compressibility")
    np.testing.assert_array_equal(reward(IMAGES, PROMPTS), local(IMAGES, PROMPTS))
    videos = IMAGES[:6].reshape(2, 3, 24, 24, 3)
    remote_scores, remote_frames = reward.with_frames(videos, ["a", "b"])
    local_scores, local_frames = local.with_frames(videos, ["a", "b"])
    np.testing.assert_allclose(remote_scores, local_scores, rtol=1e-6)
    np.testing.assert_array_equal(remote_frames, local_frames)


def test_wire_images_round_trip():
    u8 = remote.to_uint8(IMAGES[:2])
    for fmt in remote.FORMATS:
        np.testing.assert_array_equal(remote.decode_item(remote.encode_item(u8[0], fmt)), u8[0])
    video = remote.encode_item(u8, "png")  # [T, H, W, C] travels as frames
    np.testing.assert_array_equal(remote.decode_item(json.loads(json.dumps(video))), u8)


def test_scores_come_back_in_the_order_sent_across_servers():
    """Two servers, the first answering slowly: each request's scores land where they were
    sent from, whichever answer comes first."""

    def by_prompt(delay):
        def answer(index, body):
            time.sleep(delay)
            return json_answer({"scores": [float(p[1:]) for p in body["prompts"]]})

        return answer

    with scripted(by_prompt(0.3)) as (slow, slow_record), scripted(by_prompt(0)) as (fast, _):
        reward = load(f"{slow}/a,{fast}/b", batch_size=2, in_flight=4)
        np.testing.assert_array_equal(reward(IMAGES, PROMPTS), np.arange(7, dtype=np.float32))
    assert len(slow_record.requests) == 2  # 4 requests of 2, 2, 2, 1 images taken in turn


def test_metadata_and_sub_scores_travel_unchanged():
    geneval = [
        {"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "two cats"},
        None,
    ]

    def answer(index, body):
        return json_answer({"scores": [1.0, 2.0], "sub_scores": {"ocr": [0.5, 0.25]}})

    with scripted(answer) as (url, record):
        reward = load(url)
        combined = rewards.combined_reward({"remote:r": 1.0}, {"remote:r": reward})
        total, parts, _ = combined.with_frames(IMAGES[:2], ["two cats", "x"], geneval)
    np.testing.assert_array_equal(total, [1.0, 2.0])
    np.testing.assert_array_equal(parts["remote:r/ocr"], [0.5, 0.25])
    _, headers, body = record.requests[0]
    assert body["metadata"] == geneval and body["prompts"] == ["two cats", "x"]
    assert headers["Content-Type"] == "application/json"


def test_a_callable_server_gets_images_prompts_and_metadata(monkeypatch):
    seen = {}

    def scorer(images, prompts, metadata):
        seen.update(shape=images.shape, dtype=images.dtype, prompts=prompts, metadata=metadata)
        return np.asarray(images).mean(axis=(1, 2, 3))

    import sys
    import types

    module = types.ModuleType("scorer_for_test")
    module.score = scorer
    monkeypatch.setitem(sys.modules, "scorer_for_test", module)
    with reference("--callable=scorer_for_test:score") as url:
        scores = load(url, format="png")(IMAGES[:3], PROMPTS[:3], [{"k": 1}, None, {"k": 3}])
    expected = remote.to_uint8(IMAGES[:3]).mean(axis=(1, 2, 3)) / 255
    np.testing.assert_allclose(scores, expected, rtol=1e-6)
    assert seen["shape"] == (3, 24, 24, 3) and seen["dtype"] == np.float32
    assert seen["metadata"] == [{"k": 1}, None, {"k": 3}]


def test_server_errors_are_retried_then_one_sentence():
    crashed = json_answer({"error": "scorer crashed"}, 500)
    with (
        scripted(lambda i, b: crashed) as (url, record),
        pytest.raises(RewardUnavailable) as info,
    ):
        load(url, retries=2, backoff_s=0.01)(IMAGES[:2], PROMPTS[:2])
    assert len(record.requests) == 3
    message = str(info.value)
    assert "\n" not in message and url in message
    assert "failed 3 time(s), the last with HTTP status 500 (scorer crashed)" in message


def test_a_retry_that_succeeds_scores():
    def answer(index, body):
        if index == 0:
            return json_answer({}, 503)
        return json_answer({"scores": [0.0] * len(body["images"])})

    with scripted(answer) as (url, record):
        np.testing.assert_array_equal(load(url, backoff_s=0.01)(IMAGES[:2], PROMPTS[:2]), [0, 0])
    assert len(record.requests) == 2


def test_a_stalled_server_times_out():
    def answer(index, body):
        time.sleep(1.0)
        return json_answer({"scores": [0.0] * len(body["images"])})

    with (
        scripted(answer) as (url, _),
        pytest.raises(RewardUnavailable, match=r"no full answer within 0.2s"),
    ):
        load(url, timeout_s=0.2, retries=1, backoff_s=0)(IMAGES[:1], PROMPTS[:1])


@pytest.mark.parametrize(
    "answer, said",
    [
        (json_answer({"scores": [1.0]}), r"answered 1 value\(s\) in its 'scores' field for 2"),
        (
            (200, {"Content-Type": "application/json"}, b'{"scores": [1.0, NaN]}'),
            r"non-finite value \(nan\) at position 1 of its 'scores' field",
        ),
        ((200, {"Content-Type": "application/json"}, b"{scores"), "answered malformed JSON"),
        (json_answer({"scores": [1, 2]}, kind="text/html"), "content type 'text/html'"),
        (json_answer({"score": [1, 2]}), "answered no 'scores' field"),
        (json_answer({"scores": [1, "x"]}), r"'x' at position 1 of its 'scores' field"),
        (
            json_answer({"scores": [1, 2], "sub_scores": {"ocr": [1]}}),
            r"'sub_scores.ocr' field for 2",
        ),
        (json_answer({"error": "no such route"}, 404), r"HTTP status 404 \(no such route\)"),
    ],
)
def test_a_bad_answer_is_one_sentence_naming_the_server_and_field(answer, said):
    with (
        scripted(lambda i, b: answer) as (url, record),
        pytest.raises(RewardUnavailable, match=said) as info,
    ):
        load(url)(IMAGES[:2], PROMPTS[:2])
    assert url in str(info.value) and "\n" not in str(info.value)
    assert len(record.requests) == 1  # not retried: the server would answer the same


def test_redirects_stay_on_the_host_and_the_token_goes_nowhere_else(monkeypatch):
    monkeypatch.setenv("TEST_REMOTE_TOKEN", "Bearer s3cret")
    with scripted(lambda i, b: json_answer({"scores": [4.0]})) as (other, other_record):
        other = other.replace("127.0.0.1", "localhost")  # another host name, same machine

        def answer(index, body):
            path = record.requests[-1][0]
            if path == "/old":
                return 307, {"Location": "/new"}, b""
            if path == "/away":
                return 307, {"Location": f"{other}/score"}, b""
            return json_answer({"scores": [3.0]})

        with scripted(answer) as (url, record):
            reward = load(f"{url}/old", header="Authorization", token_env="TEST_REMOTE_TOKEN")
            np.testing.assert_array_equal(reward(IMAGES[:1], PROMPTS[:1]), [3.0])
            assert [r[0] for r in record.requests] == ["/old", "/new"]
            assert all(r[1]["Authorization"] == "Bearer s3cret" for r in record.requests)
            away = load(f"{url}/away", header="Authorization", token_env="TEST_REMOTE_TOKEN")
            with pytest.raises(RewardUnavailable, match="redirected to another host"):
                away(IMAGES[:1], PROMPTS[:1])
    assert other_record.requests == []


def test_a_server_down_is_one_sentence_before_scoring():
    options = settings("http://127.0.0.1:9/score")
    sentence = families.unreachable(["remote:r"], options)
    assert sentence.startswith("remote reward 'remote:r': nothing answers at http://127.0.0.1:9")
    with scripted(lambda i, b: json_answer({})) as (url, record):
        assert families.unreachable(["remote:r"], settings(url)) is None
    assert record.requests == []  # the probe connects and scores nothing


def test_a_missing_token_variable_is_one_sentence(monkeypatch):
    monkeypatch.delenv("TEST_REMOTE_TOKEN", raising=False)
    options = settings("http://127.0.0.1:9/", header="X-Key", token_env="TEST_REMOTE_TOKEN")
    assert "environment variable TEST_REMOTE_TOKEN, which is not set" in families.unreachable(
        ["remote:r"], options
    )


# ---------------------------------------------------------------------------------------------
# The config.


def _config(**fields):
    c = cfg.base_config()
    c.rewards = "remote:r"
    section = {**remote.settings().to_dict(), "url": "http://127.0.0.1:8000/score", **fields}
    c.reward_options.remote = ml_collections.ConfigDict({"r": section})
    return c


def test_the_rewards_string_names_remote_rewards():
    assert rewards.parse_rewards("remote:judge") == {"remote:judge": 1.0}
    assert rewards.parse_rewards("remote:a:0.5,jpeg_compressibility:0.1") == {
        "remote:a": 0.5,
        "jpeg_compressibility": 0.1,
    }
    with pytest.raises(cfg.ConfigError, match="names no remote reward"):
        rewards.parse_rewards("remote")
    assert cfg.validate(_config(), rewards.available_rewards()) == {"remote:r": 1.0}


@pytest.mark.parametrize(
    "fields, said",
    [
        (dict(url=""), "reward_options.remote.r.url is missing"),
        (dict(url="ftp://host/x"), "is not an http:// or https:// URL"),
        (dict(timeout_s=-1.0), "timeout_s must be in (0, 3600] (seconds for one whole request)"),
        (dict(batch_size=0), "batch_size must be at least 1"),
        (dict(retries=-1), "retries must be in [0, 20] (further tries), got -1."),
        (dict(format="jpeg"), "format must be one of png, raw, got 'jpeg'."),
        (dict(header="Authorization"), "sets one of header and token_env"),
        (dict(timeout_s="soon"), "timeout_s must be a finite number"),
        (dict(tiemout_s=3.0), "sets 'tiemout_s', which is not a setting"),
    ],
)
def test_a_bad_setting_is_one_sentence(fields, said):
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(_config(**fields), rewards.available_rewards())
    assert said in str(info.value) and "\n" not in str(info.value)


def test_a_remote_reward_without_settings_is_one_sentence():
    c = cfg.base_config()
    c.rewards = "remote:judge"
    with pytest.raises(cfg.ConfigError, match=r"reward 'remote:judge' has no settings: set "):
        cfg.validate(c, rewards.available_rewards())


def test_command_line_overrides_add_a_remote_reward():
    from tree_grpo_jax.cli import config_flag

    c = config_flag.apply_overrides(
        cfg.base_config(),
        [
            ("", "rewards", "remote:judge"),
            ("", "reward_options.remote.judge.url", "http://127.0.0.1:8000/score"),
            ("", "reward_options.remote.judge.batch_size", "4"),
        ],
    )
    assert c.reward_options.remote.judge.batch_size == 4
    assert c.reward_options.remote.judge.timeout_s == remote.settings().timeout_s
    cfg.validate(c, rewards.available_rewards())
    with pytest.raises(config_flag.BadCommandLine, match="no field"):
        config_flag.apply_overrides(c, [("", "reward_options.remote.judge.uurl", "x")])


def test_bad_server_flags_are_one_sentence(capsys):
    for flags, said in [
        ([], "give one of --reward"),
        (["--reward=jpeg_compressibility", "--callable=a:b"], "give one of --reward"),
        (["--reward=nope"], "unknown reward 'nope'"),
        (["--callable=no_such_module_xyz:f"], "module 'no_such_module_xyz' could not be"),
        (["--callable=json"], "must be module:function"),
        (["--port=x"], "invalid int value"),
        (["--reward=jpeg_compressibility", "--port=99999"], "--port=99999 is not a port"),
        (["--reward=jpeg_compressibility", "--host=no.such.host.invalid"], "cannot listen"),
    ]:
        assert serve.main(flags) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err


def test_a_video_reward_sends_whole_videos(jpeg_server):
    """`media="video"`: each video travels as its frames and gets one score (here the
    server's image reward gives the mean over the frames, as the run would)."""
    reward = load(f"{jpeg_server}/score", media="video", format="png")
    assert reward.media == "video"
    videos = IMAGES[:6].reshape(2, 3, 24, 24, 3)
    local = rewards.get_reward("jpeg_compressibility")
    np.testing.assert_allclose(reward(videos, ["a", "b"]), local(videos, ["a", "b"]), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# A request's deadline, the server's Retry-After, the bounds of the numbers.


@pytest.mark.parametrize("in_headers", [False, True], ids=["body", "headers"])
def test_a_trickling_server_is_cut_off_at_each_requests_deadline(in_headers):
    """A server that keeps the answer alive one byte every 0.05 s (which a timeout per read
    never ends) is cut off `timeout_s` after each request's start: two tries of 0.4 s and
    a backoff of 0.1 s between them."""
    timeout, backoff = 0.4, 0.1
    with trickling(0.05, in_headers) as (url, lasted):
        reward = load(url, timeout_s=timeout, retries=1, backoff_s=backoff)
        start = time.monotonic()
        with pytest.raises(RewardUnavailable) as info:
            reward(IMAGES[:1], PROMPTS[:1])
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 2
        while len(lasted) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the server's side notices at its next write
    assert "failed 2 time(s), the last with no full answer within 0.4s" in str(info.value)
    assert 2 * timeout + backoff <= elapsed < 2 * timeout + backoff + 0.5, elapsed
    assert len(lasted) == 2 and all(t < timeout + 0.3 for t in lasted), lasted


def _answered_after(first, timeout_s=5.0):
    """(the seconds between a first answer `first` and the retry that follows it, scores)."""

    def answer(index, body):
        return first if index == 0 else json_answer({"scores": [1.0]})

    with scripted(answer) as (url, record):
        scores = load(url, timeout_s=timeout_s, backoff_s=0.01)(IMAGES[:1], PROMPTS[:1])
    return record.times[1] - record.times[0], scores


def test_retry_after_is_honoured_within_one_requests_deadline():
    busy = json_answer({"error": "busy"}, 429)
    waited, scores = _answered_after((busy[0], {**busy[1], "Retry-After": "1"}, busy[2]))
    np.testing.assert_array_equal(scores, [1.0])
    assert 1.0 <= waited < 1.4, waited  # not the 0.01 s backoff
    # a wait longer than a request may take is cut to timeout_s
    waited, _ = _answered_after((503, {"Retry-After": "3600"}, b""), timeout_s=0.3)
    assert 0.3 <= waited < 0.7, waited


def test_retry_after_reads_seconds_and_http_dates():
    in_two = email.utils.formatdate(time.time() + 2, usegmt=True)
    assert remote.retry_after({"retry-after": "7"}) == 7.0
    assert 0.5 < remote.retry_after({"retry-after": in_two}) <= 2.0
    assert remote.retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    for unread in ("", "soon", "-3", "1.5"):
        assert remote.retry_after({"retry-after": unread}) is None
    assert remote.retry_after({}) is None


@pytest.mark.parametrize(
    "fields, said",
    [
        (
            dict(timeout_s=1e300),
            "timeout_s must be in (0, 3600] (seconds for one whole request), got 1e+300.",
        ),
        (dict(timeout_s=float("nan")), "timeout_s must be a finite number, got nan."),
        (dict(backoff_s=1e300), "backoff_s must be in [0, 600] (seconds), got 1e+300."),
        (dict(backoff_s=float("inf")), "backoff_s must be a finite number, got inf."),
        (dict(retries=10**6), "retries must be in [0, 20] (further tries), got 1000000."),
        (dict(in_flight=10**6), "in_flight must be in [1, 256] (requests at once)"),
        (dict(retries=10**5000), "got a number of thousands of digits."),
        (dict(retries=1.5), "retries must be a whole number, got 1.5."),
        (dict(batch_size="x" * 10_000), "must be a whole number, got 'xxxxx"),
        (
            dict(header="Bad Header" * 1000, token_env="T"),
            "(10,000 characters) is not a header name.",
        ),
    ],
)
def test_numbers_past_their_bounds_are_one_short_sentence(fields, said):
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(_config(**fields), rewards.available_rewards())
    message = str(info.value)
    assert said in message and "\n" not in message and len(message) < 300, message


# ---------------------------------------------------------------------------------------------
# Secrets: a token the header cannot carry, a URL's password.


@pytest.mark.parametrize(
    "token, said",
    [
        ("Bearer s3cret-7f\n", "ends with a line break (a newline)"),
        ("Bearer s3cret-7f\r\n", "ends with a line break (CR LF)"),
        ("Bearer s3cret-7f\r", "ends with a carriage return"),
        ("Bearer s3cret-7f\nX-Injected: 1", "holds a control character"),
        ("Bearer s3cret-7f\u2014", "holds a character outside Latin-1"),
        ("", "which is set but empty"),
    ],
)
def test_a_token_a_header_cannot_carry_is_named_by_its_variable(monkeypatch, token, said):
    """Said by the start's probe and by the client itself, naming the variable, never the
    value, and nothing is sent."""
    monkeypatch.setenv("TEST_REMOTE_TOKEN", token)
    fields = dict(header="Authorization", token_env="TEST_REMOTE_TOKEN")
    with scripted(lambda i, b: json_answer({"scores": [1.0]})) as (url, record):
        probed = families.unreachable(["remote:r"], settings(url, **fields))
        with pytest.raises(RewardUnavailable) as info:
            load(url, **fields)(IMAGES[:1], PROMPTS[:1])
    assert record.requests == []
    for sentence in (probed, str(info.value)):
        assert "environment variable TEST_REMOTE_TOKEN" in sentence and said in sentence
        assert "s3cret" not in sentence and "\n" not in sentence, sentence


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://bob:s3cret@127.0.0.1:8000/score", "'http://***@127.0.0.1:8000/score'"),
        ("https://s3cret@host/score", "'https://***@host/score'"),
        ("ftp://bob:s3cret@host/x", "'ftp://***@host/x'"),  # said before the scheme
        ("bob:s3cret@host:80/x", "'***@host:80/x'"),  # no scheme
        ("http://a/x,http://bob:s3c,ret@host/", "'***@host/'"),  # a comma in the password
    ],
)
def test_a_url_with_a_password_is_refused_without_showing_it(url, shown):
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(_config(url=url), rewards.available_rewards())
    message = str(info.value)
    assert f"url {shown} carries a user name or password" in message, message
    assert "s3c" not in message and "ret@" not in message
    assert "header=Authorization" in message and "token_env" in message


def test_every_sentence_quoting_a_url_hides_its_password():
    assert remote.redacted("http://u:p@h/x?q=a@b") == "http://***@h/x?q=a@b"
    assert remote.redacted("http://h/x?q=a@b") == "http://h/x?q=a@b"  # no credentials
    for url in ("http://h:99999/", "http://h/sp ace"):  # other faults, other sentences
        with pytest.raises(cfg.ConfigError) as info:
            cfg.validate(_config(url=url), rewards.available_rewards())
        assert repr(url) in str(info.value)


# ---------------------------------------------------------------------------------------------
# The reference server's command line.


def _module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return str(tmp_path / f"{name}.py")


@pytest.mark.parametrize(
    "source, said",
    [
        ("x = 1\nraise RuntimeError('no GPU here')\n", "raised RuntimeError: no GPU here while "),
        ("def score(images:\n    pass\n", "has a syntax error at {file}:1 ("),
        ("import sys\nsys.exit(3)\n", "called sys.exit(3) while being imported"),
        (
            "import no_such_dependency_xyz\n",
            "could not be imported (ModuleNotFoundError: No module named",
        ),
    ],
)
def test_a_callable_module_that_fails_to_import_is_one_sentence(
    tmp_path, monkeypatch, capsys, source, said
):
    name = f"scorer_{abs(hash(source)) % 10**8}"
    file = _module(tmp_path, monkeypatch, name, source)
    assert serve.main([f"--callable={name}:score", "--port=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --callable: module {name!r} "), err
    assert said.format(file=file) in err and "Traceback" not in err, err
    if "RuntimeError" in said:
        assert f"imported at {file}:2." in err  # where it was raised


def test_the_reward_models_flag_named_is_serves_own(capsys, tmp_path):
    for flags, said in [
        (["--reward=hpsv2"], "needs a converted HPS-v2.1 folder: set --reward_model=/path"),
        (["--reward=hpsv2", f"--reward_model={tmp_path / 'none'}"], "point --reward_model at"),
        (["--reward=jpeg_compressibility", f"--reward_model={tmp_path}"], "no --reward_model"),
    ]:
        assert serve.main([*flags, "--port=0"]) == 2
        err = capsys.readouterr().err
        assert said in err and "--config" not in err and err.count("\n") == 1, err


def test_the_url_printed_is_the_one_the_docs_put_in_a_runs_config():
    """The first line names `/score`, as the docs' run command does, and the docs show the
    line as the server prints it."""
    import pathlib

    flags = ["--reward=jpeg_compressibility", "--port=0"]
    server, what = serve.make_server(serve.parser().parse_args(flags))
    server.server_close()
    port = server.server_address[1]
    assert serve.url_of(server) == f"http://127.0.0.1:{port}/score"
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "prompts-and-rewards.md").read_text()
    assert serve.serving_line(what, "http://127.0.0.1:8000/score") in docs
    assert "--config.reward_options.remote.judge.url=http://127.0.0.1:8000/score" in docs
