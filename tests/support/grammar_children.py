"""A stand-in for grammar.pool's child: the real answering loop, with a compile that never
finishes a text holding "HANG" (burning CPU, as an uninterruptible compile would) and
accepts everything else."""

from ssdlocal.grammar.pool import answer_forever


def _compile(kind: str, text: str) -> None:
    while "HANG" in text:
        pass


def hanging_serve(conn, vocabulary, vocab_size, eos_ids) -> None:
    conn.send(("ready",))
    answer_forever(conn, _compile)
