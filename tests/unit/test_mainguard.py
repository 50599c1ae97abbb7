"""Whether fit's DataLoader workers would run the user's script again (train/mainguard.py): the
statement of the main module running now, inside ``if __name__ == "__main__":`` or not, and which
main modules multiprocessing re-imports at all. The real thing: tests/faults/test_bad_input.py."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest

from ddprun.train import mainguard
from ddprun.train.data import choose_num_workers

SCRIPT = textwrap.dedent('''\
    import ddprun                               # 1
    def main():                                 # 2
        ddprun.fit(...)                         # 3
    main()                                      # 4
    if __name__ == "__main__":                  # 5
        main()                                  # 6
    else:                                       # 7
        main()                                  # 8
    if "__main__" == __name__ and True:         # 9
        try:                                    # 10
            main()                              # 11
        finally:                                # 12
            pass                                # 13
    with open("x") as f:                        # 14
        if __name__ == "__main__":              # 15
            main()                              # 16
    for i in range(2):                          # 17
        main()                                  # 18
    if __name__ == "__main__":                  # 19
        @run_it                                 # 20
        def go():                               # 21
            main()                              # 22
    if (__name__ == "__main__"                  # 23
            and main()):                        # 24
        pass                                    # 25
    if __name__ != "__main__":                  # 26
        pass                                    # 27
    else:                                       # 28
        main()                                  # 29
    if __name__ == "__main__":                  # 30
        pass                                    # 31
    elif True:                                  # 32
        main()                                  # 33
    match 1:                                    # 34
        case 1:                                 # 35
            main()                              # 36
''')


@pytest.mark.parametrize("line, guarded", [(4, False), (6, True), (8, False), (11, True), (13, True), (16, True),
                                           (18, False), (1, False), (20, True), (24, True), (29, True),
                                           (33, False), (36, False)])
def test_a_line_is_guarded_only_inside_the_body_of_a_main_test(line, guarded):
    """A decorator, the test itself, an ``else`` of ``!=`` (any other test of ``__name__``: not
    known, so guarded); an ``elif`` of ``==`` runs on a re-import."""
    assert mainguard.guarded(SCRIPT, line) is guarded


def test_unparsable_source_changes_nothing():
    assert mainguard.guarded("def (:\n", 1) is True


@pytest.mark.parametrize("main, path", [
    (SimpleNamespace(__file__="/job/train.py", __spec__=None), "/job/train.py"),
    (SimpleNamespace(__file__="/job/train.py", __spec__=SimpleNamespace(name="pkg.train")), "/job/train.py"),
    (SimpleNamespace(__file__="/job/pkg/__main__.py", __spec__=SimpleNamespace(name="pkg.__main__")), None),
    (SimpleNamespace(__file__="/usr/bin/ipython", __spec__=None), None),
    (SimpleNamespace(__spec__=None), None),  # a notebook, python -c
])
def test_only_a_main_module_multiprocessing_reimports_counts(main, path):
    assert mainguard.reimported(main) == path


def test_a_relative_path_is_the_one_multiprocessing_reimports(tmp_path, monkeypatch):
    """spawn.py joins it to the directory the process started in; the script may have left it."""
    monkeypatch.setattr(mainguard.process, "ORIGINAL_DIR", str(tmp_path))
    monkeypatch.chdir("/")
    assert mainguard.reimported(SimpleNamespace(__file__="train.py", __spec__=None)) == str(tmp_path / "train.py")


def test_find_reads_the_main_modules_running_statement(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom ddprun.train import mainguard\nFOUND = mainguard.find()\n"
                      "if __name__ == '__main__':\n    GUARDED = mainguard.find()\n")
    main = SimpleNamespace(__file__=str(script), __spec__=None, __name__="__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(script.read_text(), str(script), "exec"), vars(main))
    assert main.FOUND == mainguard.Unguarded(str(script), 3)
    assert main.GUARDED is None
    assert mainguard.find() is None  # called from here, not from the main module's top level


def test_choose_num_workers_keeps_workers_where_nothing_reruns():
    assert mainguard.find() is None  # pytest's main module is a package's __main__
    assert choose_num_workers(None, object(), 1, cpus=8) == 2
