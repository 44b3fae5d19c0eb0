"""The in-job calls in a process that does not run under aidn (a script run
by hand), SIGTERM and should_stop(), and report()'s argument checks."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import aidn

from aidn_testing import no_aidn_env

BY_HAND = r'''
import os, aidn
for step in range(1, 4):
    aidn.report(step, loss=0.5, samples=64, epoch=1, test_accuracy=0.9)
with aidn.checkpoint(3) as path:
    assert os.path.isdir(path) and os.listdir(path) == []
    open(os.path.join(path, "model.pt"), "wb").write(b"weights")
    kept = path
print("gone", not os.path.exists(kept))
print("resume", aidn.resume())
print("stop", aidn.should_stop())
print("flush", aidn.flush(1))
print("job", aidn.current_job())
'''

UNTIL_STOPPED = r'''
import time, aidn
aidn.should_stop()
print("running", flush=True)
while not aidn.should_stop():
    time.sleep(0.01)
print("stopped", flush=True)
'''

NEVER_ASKS = r'''
import time, aidn
aidn.report(1, loss=1.0)
print("running", flush=True)
time.sleep(60)
'''


def run(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


class StandaloneTest(unittest.TestCase):
    def test_calls_are_harmless_outside_aidn_with_one_warning(self):
        result = run(BY_HAND, no_aidn_env())
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.split("\n")[:5],
                         ["gone True", "resume None", "stop False", "flush True", "job None"])
        self.assertEqual(result.stderr.count("not running under aidn"), 1, result.stderr)

    def test_a_checkpoint_directory_without_a_job_gets_a_verified_checkpoint(self):
        directory = tempfile.mkdtemp(prefix="aidn-standalone-")
        self.addCleanup(shutil.rmtree, directory, True)
        env = no_aidn_env()
        env["AIDN_CHECKPOINT_DIR"] = directory
        result = run(BY_HAND, env)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(os.listdir(directory)), ["step-00000003"])
        path = os.path.join(directory, "step-00000003")
        self.assertEqual(aidn.verify_checkpoint_dir(path).step, 3)
        # The same directory as a resume point, verified.
        env["AIDN_RESUME_STEP"], env["AIDN_RESUME_PATH"] = "3", path
        result = run("import aidn; print(aidn.resume())", env)
        self.assertEqual(result.stdout.strip(), f"Resume(step=3, path='{path}')", result.stderr)
        env["AIDN_RESUME_STEP"] = "4"
        result = run("import aidn; print(aidn.resume())", env)
        self.assertEqual(result.stdout.strip(), "None")
        self.assertIn("MANIFEST: says step 3", result.stderr)

    def test_sigterm_makes_should_stop_true(self):
        process = subprocess.Popen([sys.executable, "-c", UNTIL_STOPPED], env=no_aidn_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(process.stdout.readline().strip(), "running")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
        self.assertEqual(process.returncode, 0, err)
        self.assertEqual(out.strip(), "stopped")

    def test_sigterm_keeps_its_default_for_a_program_that_never_asks(self):
        process = subprocess.Popen([sys.executable, "-c", NEVER_ASKS], env=no_aidn_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(process.stdout.readline().strip(), "running")
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        self.assertEqual(process.returncode, -signal.SIGTERM)

    def test_report_refuses_unknown_names_and_bad_values(self):
        with self.assertRaises(TypeError) as caught:
            aidn.report(1, loss=0.1, accuracy=0.5, foo=1)
        message = str(caught.exception)
        self.assertIn("accuracy, foo", message)
        self.assertIn("test_accuracy", message)
        for bad in ("high", "1.5", [1.0]):
            with self.assertRaises(TypeError) as caught:
                aidn.report(1, loss=bad)
            self.assertIn(f"loss must be a number, not {type(bad).__name__}",
                          str(caught.exception))
        with self.assertRaises(TypeError):
            aidn.report(1.5)
        with self.assertRaises(ValueError):
            aidn.report(-1)

    def test_an_exception_in_the_block_leaves_nothing(self):
        directory = tempfile.mkdtemp(prefix="aidn-standalone-")
        self.addCleanup(shutil.rmtree, directory, True)
        env = no_aidn_env()
        env["AIDN_CHECKPOINT_DIR"] = directory
        code = ("import os, aidn\n"
                "try:\n"
                "    with aidn.checkpoint(9) as path:\n"
                "        open(os.path.join(path, 'x'), 'w').write('x')\n"
                "        raise KeyError('boom')\n"
                "except KeyError:\n"
                "    print('raised')\n"
                "try:\n"
                "    with aidn.checkpoint(10) as path:\n"
                "        os.mkdir(os.path.join(path, 'sub'))\n"
                "except ValueError as e:\n"
                "    print(e)\n")
        result = run(code, env)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.split("\n")[0], "raised")
        self.assertIn("sub: only plain files", result.stdout)
        self.assertEqual(os.listdir(directory), [])


if __name__ == "__main__":
    unittest.main()
