"""A stand-in for grammar.pool's child: it never finishes a text holding "HANG"
(burning CPU, as an uninterruptible compile would) and accepts everything else."""


def hanging_serve(conn, vocabulary, vocab_size, eos_ids) -> None:
    conn.send(("ready",))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        if "HANG" in text:
            while True:
                pass
        conn.send(("ok",))
