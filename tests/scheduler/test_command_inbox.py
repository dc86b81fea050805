"""Commands from other threads reach the engine loop, which sleeps in a zmq poll."""
from __future__ import annotations

import threading

import zmq

from scheduler.command_inbox import CommandInbox


def test_a_command_from_another_thread_wakes_the_loop_and_gets_its_answer():
    ctx = zmq.Context()
    inbox = CommandInbox(ctx)
    poller = zmq.Poller()
    poller.register(inbox.socket, zmq.POLLIN)
    futures = []
    senders = [threading.Thread(target=lambda: futures.append(inbox.submit("reset_prefix_cache")))
               for _ in range(3)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    answered = 0
    while answered < 3:
        assert dict(poller.poll(5000)).get(inbox.socket), "the loop was not woken"
        for name, future in inbox.take():
            assert name == "reset_prefix_cache"
            future.set_result(True)
            answered += 1
    assert all(f.result(timeout=1) for f in futures) and inbox.take() == []
    assert not poller.poll(0)  # every wakeup was consumed: the loop sleeps again
    inbox.close()
    ctx.term()
