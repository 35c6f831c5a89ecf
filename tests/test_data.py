"""substrax.data: token files and text in windows, each step's batch read per process."""

import json

import numpy as np
import pytest

from substrax import data

IDS = np.arange(1, 402, dtype=np.uint16) % 97  # 401 ids: 40 windows of 10 + 1


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "train.bin"
    IDS.tofile(path)
    return path


def _windows(path, seq=10):
    return data.TokenWindows(data.load_tokens(path), seq)


def _global_batch(windows, step, batch_size, processes, **kwargs):
    """Global batch ``step`` as the processes read it, concatenated in process order."""
    return np.concatenate([
        data.Batches(windows, batch_size, process_index=p, process_count=processes, **kwargs)(step)
        for p in range(processes)
    ])  # fmt: skip


def test_a_token_file_is_memory_mapped_and_cut_into_overlapping_windows(token_file):
    tokens = data.load_tokens(token_file)
    assert isinstance(tokens.ids, np.memmap) and tokens.ids.dtype == np.uint16
    assert tokens.vocab_size is None and tokens.tokenizer is None
    windows = data.TokenWindows(tokens, 10)
    assert len(windows) == 40
    for i in (0, 7, 39):  # window i is ids [10 i, 10 i + 11): each id a target once
        np.testing.assert_array_equal(windows[i], IDS[10 * i : 10 * i + 11].astype(np.int32))
    assert windows[0].dtype == np.int32
    with pytest.raises(IndexError, match="window 40 of 40"):
        windows[40]


def test_npy_txt_and_jsonl_sources(tmp_path):
    np.save(tmp_path / "ids.npy", IDS.astype(np.uint32))
    np.testing.assert_array_equal(data.load_tokens(tmp_path / "ids.npy").ids, IDS)
    (tmp_path / "a.txt").write_text("héllo")
    text = data.load_tokens(tmp_path / "a.txt")
    assert text.ids.tolist() == list("héllo".encode()) and text.tokenizer == "bytes"
    assert text.vocab_size == max("héllo".encode()) + 1
    lines = [json.dumps({"text": "one"}), "", json.dumps({"text": "two", "id": 3})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines))
    joined = data.load_tokens(tmp_path / "b.jsonl").ids.tobytes().decode()
    assert joined == "one" + data.DOCUMENT_SEPARATOR + "two"


def test_a_hugging_face_tokenizer_reads_text_and_decodes_it(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    corpus = "the cat sat on the mat. the dog sat on the log. " * 20
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([corpus], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(corpus)
    tokens = data.load_tokens(tmp_path / "corpus.txt", tokenizer=tmp_path / "tokenizer.json")
    expected = tokenizer.encode(corpus).ids
    assert tokens.ids.tolist() == expected and len(expected) < len(corpus) / 2
    assert tokens.vocab_size == tokenizer.get_vocab_size()
    path = str(tmp_path / "tokenizer.json")
    assert data.encode("the cat", path).tolist() == tokenizer.encode("the cat").ids
    assert data.decode(data.encode("the cat", path), path) == "the cat"


def test_bytes_encode_and_decode_round_trip():
    ids = data.encode("Thou art ô")
    assert ids.dtype == np.int32 and data.decode(ids) == "Thou art ô"
    assert data.decode([72, 300, 105]) == "H\ufffdi"  # an id no byte has: U+FFFD


@pytest.mark.parametrize(
    ("name", "content", "kwargs", "error", "message"),
    [
        ("x.csv", b"1,2", {}, ValueError, "unknown data format '.csv'; expected one of .bin (raw"),
        ("x.bin", b"\0\0\0", {}, ValueError, "has 3 bytes, not a whole number of uint16 ids"),
        ("x.bin", b"\0\0", {"dtype": "float32"}, ValueError, "dtype='float32' for"),
        ("x.bin", b"\0\0\0\0", {"tokenizer": "t.json"}, ValueError, "already holds token ids"),
        ("x.bin", b"\0\0", {}, ValueError, "holds 1 token(s); a window needs at least 2"),
        ("x.jsonl", b'{"text": "a"}\n[1]\n', {}, ValueError, "x.jsonl:2: expected an object"),
        ("x.txt", b"abc", {"tokenizer": "/missing.json"}, FileNotFoundError, "'/missing.json'"),
    ],
)
def test_bad_sources_are_refused_naming_the_file_and_the_fix(
    tmp_path, name, content, kwargs, error, message
):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        data.load_tokens(tmp_path / name, **kwargs)
    with pytest.raises(FileNotFoundError, match=r"data file '.*nothing.txt' does not exist"):
        data.load_tokens(tmp_path / "nothing.txt")


def test_the_held_out_split_is_the_disjoint_tail(token_file):
    train, held = _windows(token_file).split(0.1)
    assert (len(train), len(held)) == (36, 4)
    np.testing.assert_array_equal(held[0], _windows(token_file)[36])
    with pytest.raises(ValueError, match=r"held_out=1.0: expected a fraction between 0 and 1"):
        _windows(token_file).split(1.0)
    with pytest.raises(ValueError, match="hold 0 window"):
        data.TokenWindows(data.load_tokens(token_file), 401)


def test_processes_read_disjoint_rows_that_make_the_global_batch_and_cover_the_data(token_file):
    windows = _windows(token_file)
    one = data.Batches(windows, 8, seed=3, process_index=0, process_count=1)
    halves = [data.Batches(windows, 8, seed=3, process_index=p, process_count=2) for p in (0, 1)]
    seen = []
    for step in range(5):  # 5 x 8 = the 40 windows: one pass
        a, b = halves[0](step), halves[1](step)
        assert a.shape == b.shape == (4, 11)
        np.testing.assert_array_equal(np.concatenate([a, b]), one(step))
        seen += [tuple(row) for row in one(step)]
    assert sorted(seen) == sorted(tuple(windows[i]) for i in range(40))  # each window once
    # deterministic in the seed; another seed is another order; the next pass is reshuffled
    np.testing.assert_array_equal(data.Batches(windows, 8, seed=3)(2), one(2))
    assert not np.array_equal(data.Batches(windows, 8, seed=4)(0), one(0))
    second_pass = np.concatenate([one(step) for step in range(5, 10)])
    assert sorted(map(tuple, second_pass)) == sorted(seen)
    assert not np.array_equal(second_pass, np.concatenate([one(s) for s in range(5)]))
    # evaluation reads in file order
    np.testing.assert_array_equal(data.Batches(windows, 4, shuffle=False)(1)[0], windows[4])


def test_a_resumed_order_continues_exactly_on_any_process_count(token_file):
    windows = _windows(token_file)
    run = data.Batches(windows, 8, seed=1, process_count=1, process_index=0)
    state = json.loads(json.dumps(run.state(3)))  # through the checkpoint's JSON
    assert state["position"] == 24 and state["windows"] == 40
    for processes in (1, 2, 4):
        resumed = [
            data.Batches(windows, 8, seed=1, process_index=p, process_count=processes).resumed(
                state, 3
            )
            for p in range(processes)
        ]
        for step in (3, 4, 7):
            np.testing.assert_array_equal(np.concatenate([r(step) for r in resumed]), run(step))
    # another batch size continues from the saved window, not from step x batch size
    larger = data.Batches(windows, 16, seed=1, process_count=1, process_index=0).resumed(state, 3)
    np.testing.assert_array_equal(larger(3), np.concatenate([run(3), run(4)]))


def test_a_resume_on_other_data_is_refused_naming_each_difference(token_file, tmp_path):
    state = data.Batches(_windows(token_file), 8, process_count=1, process_index=0).state(2)
    other = tmp_path / "other.bin"
    np.flip(IDS).tofile(other)
    with pytest.raises(ValueError, match=r"other data: fingerprint '\w+' \(now '\w+'\);? .*read"):
        data.Batches(_windows(other), 8, process_count=1, process_index=0).resumed(state, 2)
    with pytest.raises(ValueError, match=r"seq 10 \(now 20\), windows 40 \(now 20\)"):
        data.Batches(_windows(token_file, 20), 8, process_count=1).resumed(state, 2)


def test_bad_batches_are_refused(token_file):
    windows = _windows(token_file)
    with pytest.raises(ValueError, match="batch_size=6 does not split over 4 process"):
        data.Batches(windows, 6, process_count=4, process_index=0)
    with pytest.raises(ValueError, match=r"seed=-1: expected an integer in \[0, 2\*\*32\)"):
        data.Batches(windows, 8, seed=-1, process_count=1)
    small = data.Batches(windows, 8, vocab_size=50, process_count=1, process_index=0)
    with pytest.raises(
        ValueError, match=r"holds token id 9\d, outside the model's vocabulary of 50"
    ):
        small(0)
