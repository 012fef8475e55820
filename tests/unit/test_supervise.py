import threading
import time

from prime_rl.rl.supervise import follow_logs


def test_the_console_shows_step_lines_written_just_before_the_run_ends(tmp_path, capsys):
    """The follower reads every 0.5 s; a process's last lines, written after its last pass and before `rl` stops it,
    are shown by a final pass (the last trainer step line once went missing from the console that way)."""
    log = tmp_path / "trainer.log"
    stop = threading.Event()
    follower = threading.Thread(target=follow_logs, args=({"trainer": log}, stop))
    follower.start()
    time.sleep(0.2)  # its first pass is done (no log yet) and it waits 0.5 s for the next
    log.write_text(
        "2026-11-28 23:35:31.088 | INFO    | trainer | __main__:227 | step 7 | loss -0.0005\n"
        "2026-11-28 23:35:31.090 | WARNING | trainer | x:1 | disk almost full\n"
        "2026-11-28 23:35:31.091 | INFO    | trainer | x:2 | checkpoint written\n"
    )
    stop.set()
    follower.join(5)
    assert not follower.is_alive()
    assert capsys.readouterr().out.splitlines() == [
        "[trainer] step 7 | loss -0.0005",
        "[trainer] WARNING: disk almost full",
    ]
