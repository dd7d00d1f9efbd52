"""dtensor_demo.py's command line for a real training (--train): refused before any rank starts where its
check cannot hold. The run itself and its report are tested on the shared spawn of tests/test_dtensor.py."""

import dtensor_demo as demo  # on sys.path: conftest puts the project root there


def test_train_with_batched_ns_is_refused_in_one_line(capsys):
    """--train checks its replay against torch bit for bit; --batched-ns is not bit-identical to torch."""
    assert demo.main(["--train", "--batched-ns"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --train checks its replay against torch bit for bit, which --batched-ns does not "
                   "promise: use one of them\n"), err
