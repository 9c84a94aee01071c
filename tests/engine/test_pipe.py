"""The wire both ends of the engine-core pipe share (engine/pipe.py): the reader thread queues what it reads and
closes its queue when the pipe closes; the writer thread writes what is queued, either frames pickled as they
were queued or messages packed into frames, and says when the pipe broke under it."""
from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from tokenmill.engine.pipe import PipeReader, PipeWriter, dump_frame, load_frame

pytestmark = pytest.mark.timeout(30)


def test_the_reader_queues_frames_and_closes_its_inbox_when_the_pipe_closes():
    ours, theirs = mp.Pipe()
    reader = PipeReader(ours, None, "test-reader", "reading failed")
    theirs.send_bytes(dump_frame([("a", 1), ("b", 2)]))
    theirs.close()
    got = []
    with pytest.raises(EOFError):
        while True:
            got += reader.inbox.get(5.0)
    assert got == [("a", 1), ("b", 2)]
    reader.thread.join(5.0)
    assert not reader.thread.is_alive()


def test_the_writer_packs_queued_messages_into_one_frame():
    ours, theirs = mp.Pipe()
    writer = PipeWriter(ours, None, "test-writer", frame_bytes=1 << 20)
    writer.outbox.put_all([("add", 1), ("add", 2)], 100)
    assert load_frame(theirs.recv_bytes()) == [("add", 1), ("add", 2)]  # the two together, as one frame
    writer.close()
    assert not writer.thread.is_alive()


def test_the_writer_sends_a_snapshot_per_message_and_reports_a_broken_pipe():
    ours, theirs = mp.Pipe()
    broke = threading.Event()
    writer = PipeWriter(ours, None, "test-writer", on_broken=broke.set)
    payload = [1]
    writer.send(("outputs", payload))
    payload.append(2)  # after send: not in the frame
    assert load_frame(theirs.recv_bytes()) == [("outputs", [1])]
    theirs.close()
    writer.send(("outputs", [3]))  # the pipe is gone: the writer finds out and says so
    assert broke.wait(5.0) and writer.broken and not writer.backlog
    writer.close()
