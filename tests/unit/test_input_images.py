"""Prompt files that name input images (.jsonl, .csv, .parquet; paths relative to the file,
http(s) URLs): what each row carries, each bad input as one sentence, the stream's
determinism and resume with them; the `input_similarity` reward against a numpy
reference; input images reaching a reward, a served reward and a family's encoder; and the
check that something reads them."""

import contextlib
import copy
import http.server
import json
import pickle
import threading
import time
import types

import numpy as np
import pytest
from PIL import Image
from remote_servers import load, reference, scripted

from configs import tiny
from tree_grpo_jax import config as cfg
from tree_grpo_jax import rewards
from tree_grpo_jax.errors import ConfigError
from tree_grpo_jax.rewards import registry, remote
from tree_grpo_jax.rewards.similarity import input_similarity
from tree_grpo_jax.run import input_images as inputs
from tree_grpo_jax.run.prompts import PromptIterator, config_prompt_set, load_prompt_set

RNG = np.random.default_rng(0)
RED = np.zeros((6, 8, 3), np.uint8)
RED[..., 0] = 200
NOISE = RNG.integers(0, 256, (12, 10, 3), dtype=np.uint8)


def _png(path, pixels, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(pixels)
    (image.convert(mode) if mode else image).save(path)
    return path


@pytest.fixture
def folder(tmp_path):
    """A prompt folder: images/red.png (RGB), images/noise.png saved as RGBA."""
    _png(tmp_path / "images" / "red.png", RED)
    _png(tmp_path / "images" / "noise.png", NOISE, "RGBA")
    return tmp_path


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _error(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        prompt_set = load_prompt_set(*args, **kwargs)
        inputs.check_input_images(prompt_set.input_images)
    message = str(e.value)
    assert "\n" not in message and message.endswith("."), message
    return message


# ---------------------------------------------------------------------------------------------
# Prompt files with images.


def test_jsonl_rows_name_images_relative_to_the_file(folder):
    rows = [
        {"prompt": "make it blue", "image": "images/red.png", "strength": 0.5},
        {"prompt": "two of them", "image": ["images/noise.png", "images/red.png"]},
    ]
    got = load_prompt_set(_jsonl(folder / "edits.jsonl", rows))
    assert got.prompts == ("make it blue", "two of them") and got.has_input_images
    # the row's other fields (the image's own text too) are its metadata, unchanged
    assert got.metadata[0] == {"image": "images/red.png", "strength": 0.5}
    first, second = got.input_images
    assert [r.location for r in first] == [str(folder / "images" / "red.png")]
    np.testing.assert_array_equal(np.asarray(first[0]), RED)
    pixels = np.asarray(second[0])
    assert pixels.dtype == np.uint8 and pixels.shape == (12, 10, 3)  # RGBA read as RGB
    np.testing.assert_array_equal(pixels, NOISE)


def test_csv_and_parquet_name_images_by_column(folder):
    (folder / "edits.csv").write_text(
        "prompt,images,n\nblue,images/red.png,1\n"
        'both,"[""images/noise.png"", ""images/red.png""]",2\n'
    )
    got = load_prompt_set(str(folder / "edits.csv"))
    assert [len(r) for r in got.input_images] == [1, 2]
    assert got.metadata[0] == {"images": "images/red.png", "n": "1"}
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["blue"], "input_image": [str(folder / "images" / "red.png")]})
    pq.write_table(table, folder / "sub.parquet")
    parquet = load_prompt_set(str(folder / "sub.parquet"))
    np.testing.assert_array_equal(np.asarray(parquet.input_images[0][0]), RED)


def test_the_image_field_setting_names_or_turns_off_the_column(folder, tmp_path):
    rows = [{"prompt": "p", "picture": "images/red.png", "image": "not read"}]
    source = _jsonl(folder / "named.jsonl", rows)
    named = load_prompt_set(source, image_field="picture")
    assert named.input_images[0][0].location.endswith("red.png")
    off = load_prompt_set(source, image_field="none")
    assert not off.has_input_images and off.metadata[0]["image"] == "not read"
    plain = load_prompt_set(_jsonl(folder / "plain.jsonl", [{"prompt": "p", "k": 1}]))
    assert not plain.has_input_images and plain.input_images == ((),)
    config = tiny.get_config()
    config.prompts.source, config.prompts.image_field = source, "picture"
    assert config_prompt_set(config).has_input_images


@contextlib.contextmanager
def _image_server(delay_s: float = 0.0):
    """A local http.server: /red.png, /moved (a redirect to it), /slow.png (after delay_s),
    anything else 404. Yields its base URL and the paths asked for."""
    buffer = __import__("io").BytesIO()
    Image.fromarray(RED).save(buffer, format="PNG")
    data, asked = buffer.getvalue(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            if self.path.startswith("/moved"):
                self.send_response(302)
                self.send_header("Location", "/red.png")
                self.end_headers()
                return
            if self.path.startswith("/slow"):
                time.sleep(delay_s)
            if not self.path.split("?")[0].endswith(("red.png", "slow.png")):
                self.send_error(404)
                return
            with contextlib.suppress(OSError):
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_url_is_downloaded_and_a_bad_one_is_one_sentence_without_its_token(tmp_path):
    inputs._pixels.cache_clear()
    with _image_server() as (url, asked):
        rows = [
            {"prompt": "a", "image": f"{url}/red.png"},
            {"prompt": "b", "image": f"{url}/moved"},
        ]
        got = load_prompt_set(_jsonl(tmp_path / "u.jsonl", rows))
        inputs.check_input_images(got.input_images)
        for refs in got.input_images:
            np.testing.assert_array_equal(np.asarray(refs[0]), RED)
        bad = _jsonl(
            tmp_path / "bad.jsonl", [{"prompt": "a", "image": f"{url}/x.png?token=s3cr3t"}]
        )
        message = _error(bad)
    assert "/red.png" in asked and "/moved" in asked
    assert "cannot be downloaded (the server answered 404)" in message
    assert f"{url}/x.png" in message and "s3cr3t" not in message


def test_a_download_past_its_deadline_is_one_sentence(tmp_path, monkeypatch):
    inputs._pixels.cache_clear()
    monkeypatch.setattr(inputs, "DOWNLOAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(inputs._download, "__defaults__", (0.3,))
    with _image_server(delay_s=2.0) as (url, _):
        source = _jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "image": f"{url}/slow.png"}])
        t0 = time.monotonic()
        message = _error(source)
        assert time.monotonic() - t0 < 1.5
    assert "no whole answer within 0.3s" in message


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing", "input image '{d}/images/gone.png' does not exist; paths are read relative"),
        ("unreadable", "cannot be read as an image"),
        ("empty", "line 1 of prompt file {d}/bad.jsonl names no image in its 'image'"),
        ("number", "has '7' as its image 'image'; give a path or an http(s) URL"),
        ("absent", "line 2 of prompt file {d}/bad.jsonl names no image in its 'image'"),
        ("scheme", "with the scheme 'ftp'; an input image is a path or an http(s) URL"),
        ("unnamed", "has no 'picture' image field (its fields: 'prompt', 'image')"),
        ("two fields", "has several image fields 'image', 'images'"),
        ("folder", "input image '{d}/images' is a folder, not an image file."),
        ("bomb", "red.png' has more than 20 pixels, more than PIL opens"),
    ],
)
def test_bad_input_is_one_sentence(folder, case, said, monkeypatch):
    (folder / "images" / "text.png").write_text("not an image")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # red.png's 48 pixels: over twice it
    rows = {
        "missing": [{"prompt": "a", "image": "images/gone.png"}],
        "unreadable": [{"prompt": "a", "image": "images/text.png"}],
        "empty": [{"prompt": "a", "image": ""}],
        "number": [{"prompt": "a", "image": 7}],
        "absent": [{"prompt": "a", "image": "images/red.png"}, {"prompt": "b"}],
        "scheme": [{"prompt": "a", "image": "ftp://host/x.png"}],
        "unnamed": [{"prompt": "a", "image": "images/red.png"}],
        "two fields": [{"prompt": "a", "image": "images/red.png", "images": []}],
        "folder": [{"prompt": "a", "image": "images"}],
        "bomb": [{"prompt": "a", "image": "images/red.png"}],
    }[case]
    source = _jsonl(folder / "bad.jsonl", rows)
    kwargs = {"image_field": "picture"} if case == "unnamed" else {}
    assert said.format(d=folder) in _error(source, **kwargs)


def test_a_size_the_run_cannot_take_is_one_sentence(folder):
    got = load_prompt_set(_jsonl(folder / "p.jsonl", [{"prompt": "a", "image": "images/red.png"}]))
    inputs.check_input_images(got.input_images, inputs.required_size(6, 8))
    with pytest.raises(inputs.InputImageError) as e:
        inputs.check_input_images(got.input_images, inputs.required_size(8, 8))
    assert str(e.value).endswith("red.png' is 8x6 but the run needs 8x8 (width x height).")
    model = types.SimpleNamespace(input_image_size=lambda h, w: None if h == w else "is not square")
    with pytest.raises(inputs.InputImageError, match="red.png' is not square."):
        inputs.check_input_images(got.input_images, inputs.size_rule_of(model))


def test_image_settings_that_cannot_be_read_are_one_sentence(folder):
    text = folder / "p.txt"
    text.write_text("a\n")
    assert "is a text file, which names no images" in _error(str(text), image_field="image")
    assert "is a built-in set, which names no images" in _error("animals", image_field="image")
    config = tiny.get_config()
    config.prompts.field = config.prompts.image_field = "text"
    with pytest.raises(cfg.ConfigError, match="prompts.image_field names 'text'"):
        cfg.validate(config, known_rewards=rewards.available_rewards())


# ---------------------------------------------------------------------------------------------
# The stream carries the images as it carries the metadata.


def _image_rows(folder, n=7):
    rows = [{"prompt": f"p{i}", "image": f"images/{i}.png"} for i in range(n)]
    for i in range(n):
        _png(folder / "images" / f"{i}.png", np.full((2, 2, 3), i, np.uint8))
    return load_prompt_set(_jsonl(folder / "stream.jsonl", rows))


def _drawn(batch):
    return [(p, int(np.asarray(refs[0])[0, 0, 0])) for p, refs in zip(batch, batch.input_images)]


def test_the_stream_with_images_is_deterministic_and_resumes(folder):
    s = _image_rows(folder)
    plain = PromptIterator(s.prompts, 3, seed=4)  # the same prompts without images
    a = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    b = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    for _ in range(3):
        batch = a.next_global_batch()
        assert list(batch) == list(plain.next_global_batch())  # images change no draw
        assert _drawn(batch) == _drawn(b.next_global_batch())
        assert all(int(p[1:]) == pixel for p, pixel in _drawn(batch))
    resumed = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    resumed.load_state_dict(a.state_dict())
    assert _drawn(resumed.next_global_batch()) == _drawn(a.next_global_batch())
    shards = [
        PromptIterator(s.prompts, 2, seed=4, metadata=s.metadata, shard_index=i, num_shards=2)
        for i in range(2)
    ]
    whole = PromptIterator(s.prompts, 2, seed=4, metadata=s.metadata, num_shards=2)
    assert _drawn(whole.next_global_batch()) == sum((_drawn(x.next_batch()) for x in shards), [])


def test_row_metadata_keeps_its_images_when_copied(folder):
    row = _image_rows(folder, 1).metadata[0]
    for twin in (copy.deepcopy(row), pickle.loads(pickle.dumps(row)), copy.copy(row)):
        assert twin == row and twin.input_images == row.input_images
    assert json.loads(json.dumps(row)) == {"image": "images/0.png"}  # the wire's metadata


# ---------------------------------------------------------------------------------------------
# input_similarity against numpy.


def _reference(output, image):
    """Minus the mean squared difference after a block mean of `image` down to `output`'s
    size (integer factors only), in numpy."""
    h, w = output.shape[:2]
    fh, fw = image.shape[0] // h, image.shape[1] // w
    blocks = image.astype(np.float64).reshape(h, fh, w, fw, 3).mean(axis=(1, 3)) / 255.0
    if output.shape[-1] == 1:
        blocks = blocks.mean(axis=-1, keepdims=True)
    return -np.mean((output.astype(np.float64) - blocks) ** 2)


def test_input_similarity_equals_the_numpy_reference():
    outputs = RNG.random((3, 4, 6, 3), np.float32)
    same = RNG.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    big = RNG.integers(0, 256, (12, 12, 3), dtype=np.uint8)  # 3x and 2x box averages
    inputs_ = [[same], [big], [same, big]]
    got = input_similarity(outputs, ["a", "b", "c"], inputs_)
    expected = [
        _reference(outputs[0], same),
        _reference(outputs[1], big),
        np.mean([_reference(outputs[2], same), _reference(outputs[2], big)]),
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got.dtype == np.float32 and np.all(got < 0)
    exact = same.astype(np.float32)[None] / 255.0
    assert input_similarity(exact, ["a"], [[same]])[0] == pytest.approx(0.0, abs=1e-12)
    gray = RNG.random((1, 4, 6, 1), np.float32)
    np.testing.assert_allclose(
        input_similarity(gray, ["g"], [[big]]), [_reference(gray[0], big)], rtol=1e-5
    )


def test_input_similarity_through_the_registry_reads_the_rows_images(folder):
    reward = rewards.get_reward("input_similarity")
    assert reward.takes_input_images and not reward.takes_metadata and reward.on_host
    s = _image_rows(folder, 2)  # input images of pixel 0 and 1 (/ 255)
    one = (1 / 255) ** 2
    outputs = np.stack([np.zeros((2, 2, 3), np.float32), np.full((2, 2, 3), 2 / 255, np.float32)])
    np.testing.assert_allclose(reward(outputs, list(s.prompts), list(s.metadata)), [0, -one])
    videos = np.stack([outputs, outputs[::-1]], axis=1)  # [2, T=2, ...]: each frame scored
    scores, frames = reward.with_frames(videos, list(s.prompts), list(s.metadata))
    np.testing.assert_allclose(frames, [[0, -4 * one], [-one, -one]], rtol=1e-5)
    np.testing.assert_allclose(scores, [-2 * one, -one], rtol=1e-5)
    with pytest.raises(ValueError, match="compares each output with its prompt's input image"):
        reward(outputs, ["a", "b"], [{}, {}])


def test_a_reward_taking_input_images_and_metadata_gets_both():
    seen = {}

    def fn(images, prompts, metadata, input_images):
        seen.update(metadata=metadata, shapes=[[i.shape for i in row] for row in input_images])
        return np.zeros(len(images), np.float32)

    reward = registry.register(
        "both_for_test", fn, on_host=True, takes_metadata=True, takes_input_images=True
    )
    try:
        row = inputs.RowMetadata({"k": 1}, [RED])
        reward(np.zeros((2, 2, 2, 3), np.float32), ["a", "b"], [row, None])
    finally:
        registry.unregister("both_for_test")
    assert seen["metadata"] == [{"k": 1}, None] and seen["shapes"] == [[(6, 8, 3)], []]


# ---------------------------------------------------------------------------------------------
# Served rewards.

IMAGES = RNG.random((2, 5, 5, 3), np.float32)


def test_a_served_reward_receives_the_input_images():
    def answer(index, body):
        return (
            200,
            {"Content-Type": "application/json"},
            json.dumps({"scores": [0.0, 0.0]}).encode(),
        )

    rows = [inputs.RowMetadata({"k": 1}, [RED, NOISE]), inputs.RowMetadata({}, [NOISE])]
    with scripted(answer) as (url, record):
        reward = load(url, input_images=True)
        assert reward.takes_input_images
        reward(IMAGES, ["a", "b"], rows)
        old = load(url)  # the setting left out: the request as before
        assert not old.takes_input_images
        old(IMAGES, ["a", "b"], rows)
    sent, unchanged = record.requests[0][2], record.requests[1][2]
    assert sent["metadata"] == [{"k": 1}, {}] and "input_images" not in unchanged
    got = [[remote.decode_image(e) for e in row] for row in sent["input_images"]]
    assert [len(r) for r in got] == [2, 1]
    np.testing.assert_array_equal(got[0][0], RED)
    np.testing.assert_array_equal(got[1][0], NOISE)


def test_the_reference_server_passes_them_to_a_reward_and_a_callable(monkeypatch):
    rows = [inputs.RowMetadata({}, [RED]), inputs.RowMetadata({}, [NOISE])]
    with reference("--reward=input_similarity") as url:
        served = load(url, input_images=True)(IMAGES, ["a", "b"], rows)
    sent = remote.to_uint8(IMAGES).astype(np.float32) / 255.0  # the outputs travel as uint8
    local = input_similarity(sent, ["a", "b"], [[RED], [NOISE]])
    np.testing.assert_allclose(served, local, rtol=1e-5)
    seen = {}

    def scorer(images, prompts, metadata, input_images=None):
        seen["shapes"] = [[i.shape for i in row] for row in input_images]
        return np.zeros(len(images))

    def old_scorer(images, prompts, metadata):
        return np.ones(len(images))

    import sys

    module = types.ModuleType("image_scorer_for_test")
    module.score, module.old = scorer, old_scorer
    monkeypatch.setitem(sys.modules, "image_scorer_for_test", module)
    rows[1] = inputs.RowMetadata({}, [NOISE, RED])
    with reference("--callable=image_scorer_for_test:score") as url:
        load(url, input_images=True)(IMAGES, ["a", "b"], rows)
    assert seen["shapes"] == [[(6, 8, 3)], [(12, 10, 3), (6, 8, 3)]]
    with reference("--callable=image_scorer_for_test:old") as url:  # an older server
        np.testing.assert_array_equal(load(url)(IMAGES, ["a", "b"], rows), [1.0, 1.0])


def test_input_images_are_for_the_scores_protocol_only():
    from tree_grpo_jax.rewards.remote_settings import check_settings, settings

    s = settings()
    s.update(url="http://127.0.0.1:1/v1", protocol="chat", model="m", question="{prompt}?")
    assert check_settings("j", s) is None
    s.input_images = True
    assert "input_images is for protocol 'scores' only" in check_settings("j", s)


# ---------------------------------------------------------------------------------------------
# Who reads them: the family's hook and the check before a run.


def _model(**fields):
    return types.SimpleNamespace(name="m", encode_prompts=lambda *a, **k: (a, k), **fields)


def test_something_must_read_the_input_images(folder):
    s = _image_rows(folder, 2)
    similarity = rewards.get_reward("input_similarity")
    jpeg = rewards.get_reward("jpeg_compressibility")
    with pytest.raises(ConfigError) as e:
        inputs.check_prompt_images(_model(), [jpeg], s.metadata, "prompts.source")
    assert str(e.value) == (
        "prompts.source names input images, but model 'm' takes none (its family has no image "
        "conditioning) and no reward reads them; use a model that edits or animates images, a "
        "reward that compares with them (input_similarity), or prompts.image_field set to none."
    )
    inputs.check_prompt_images(_model(), [jpeg, similarity], s.metadata, "prompts.source")
    inputs.check_prompt_images(_model(takes_input_images=True), [], s.metadata, "x")
    with pytest.raises(ConfigError, match="x: input image .* is 2x2 but the run needs 4x4"):
        inputs.check_prompt_images(
            _model(takes_input_images=True, input_image_size=(4, 4)), [], s.metadata, "x"
        )
    with pytest.raises(ConfigError, match="reward 'input_similarity' reads each prompt's input"):
        inputs.check_prompt_images(_model(), [similarity], [{}, {}], "the eval prompts")
    inputs.check_prompt_images(_model(), [jpeg], [{}, {}], "prompts.source")  # no images


def test_a_family_taking_input_images_gets_them_with_the_prompts(folder):
    s = _image_rows(folder, 2)
    args, kwargs = inputs.encode_prompts(_model(takes_input_images=True), s.prompts, s.metadata)
    assert args == (["p0", "p1"],)
    assert [int(row[0][0, 0, 0]) for row in kwargs["input_images"]] == [0, 1]
    assert inputs.encode_prompts(_model(), s.prompts, s.metadata) == ((["p0", "p1"],), {})
