"""check() for the Python integration tests: a failed check is printed and recorded, the test goes
on and exits 1 at its end when FAILURES is not empty.

Passed checks print only when PDSERVE_TEST_VERBOSE=1 (or a test's --verbose sets VERBOSE): under
`ctest --output-on-failure` a failure's lines then come near the top of the test's output, which
is the part CI shows, not after a hundred lines of passed checks. PASSED counts the passed ones.
Single-threaded use (the tests' main thread); list appends are atomic in CPython anyway.
"""
import os

FAILURES = []
PASSED = [0]
VERBOSE = [os.environ.get("PDSERVE_TEST_VERBOSE") == "1"]


def check(cond, message):
    """Records `message` as a failure when `cond` is false (and prints it), else counts a pass."""
    if not cond:
        FAILURES.append(message)
        print("FAIL: " + message, flush=True)
        return
    PASSED[0] += 1
    if VERBOSE[0]:
        print("ok: " + message, flush=True)
