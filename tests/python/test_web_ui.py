"""The coordinator's web UI in a real browser: Debian's headless Chromium,
driven through chromedriver by python3-selenium, against a real
aidn-coordinator (--web-addr) and two real aidn-workers training 2-rank jobs
on Fashion-MNIST. Screenshots of each page are kept in AIDN_TEST_ARTIFACTS
(the build's artifacts/web_ui/).

Skips without Chromium, chromedriver, selenium or the dataset
(scripts/setup.sh installs them)."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

from aidn_testing import Coordinator, binary, wait_for

try:
    from selenium import webdriver
    from selenium.common.exceptions import NoAlertPresentException, WebDriverException
    from selenium.webdriver.common.by import By
except ImportError:  # pragma: no cover - the skip below says what to install
    webdriver = None

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
ALICE = "alice-token-0123456789abcdef0123"
BOB = "bob-token-0123456789abcdef012345"
UI_TIMEOUT = 60.0  # generous: sanitizer builds and other tests share the cores


def free_port():
    """A port nothing listens on now (the web UI keeps it across restarts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cnn_spec(steps, checkpoint_dir=""):
    spec = {"name": "web-ui-test", "world_size": 2, "device": "cpu",
            "model": {"name": "cnn"}, "batch_size": 32, "max_steps": steps,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "eval_every_steps": 100, "eval_max_samples": 512, "seed": 1,
            "labels": {"team": "vision"}}
    if checkpoint_dir:
        spec["checkpoint"] = {"dir": checkpoint_dir, "every_steps": 100}
    return spec


@unittest.skipIf(webdriver is None, "python3-selenium is not installed (scripts/setup.sh)")
@unittest.skipUnless(os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK),
                     "chromium and chromium-driver are not installed (scripts/setup.sh)")
@unittest.skipUnless(os.path.isdir(FASHION_MNIST),
                     "dataset-fashion-mnist is not installed (scripts/setup.sh)")
class WebUiTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="aidn-webui-")
        self.shots = os.environ.get("AIDN_TEST_ARTIFACTS") or os.path.join(self.dir, "shots")
        os.makedirs(self.shots, exist_ok=True)
        tokens = os.path.join(self.dir, "tokens")
        with open(tokens, "w") as f:
            f.write(f"{ALICE} user alice\n{BOB} user bob\n")
        self.web_port = free_port()
        self.coordinator = Coordinator(
            os.path.join(self.dir, "state"),
            [f"--token-file={tokens}", f"--web-addr=127.0.0.1:{self.web_port}"])
        self.coordinator.start()
        self.addCleanup(self.coordinator.stop)
        self.workers = []
        for name in ("w1", "w2"):
            self.start_worker(name)
        from aidn import Client
        self.alice = Client(self.coordinator.address, ALICE, tls_ca=self.coordinator.ca_file)
        self.addCleanup(self.alice.close)
        self.url = f"http://127.0.0.1:{self.web_port}/"
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1280,1000"):
            options.add_argument(arg)
        service = webdriver.ChromeService(executable_path=CHROMEDRIVER) \
            if hasattr(webdriver, "ChromeService") else \
            webdriver.chrome.service.Service(executable_path=CHROMEDRIVER)
        self.browser = webdriver.Chrome(service=service, options=options)
        self.addCleanup(self.browser.quit)

    def tearDown(self):
        for w in self.workers:
            if w.poll() is None:
                w.terminate()
                try:
                    w.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.kill()
        if getattr(getattr(self, "_outcome", None), "success", True):
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"kept {self.dir}\n{self.coordinator.log_tail()}")

    def start_worker(self, name):
        work = os.path.join(self.dir, name)
        os.makedirs(work, exist_ok=True)
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")
        argv = [binary("AIDN_WORKER_BIN"), f"--coordinator={self.coordinator.address}",
                f"--token-file={self.coordinator.state_dir}/worker.token", f"--worker-id={name}",
                "--cpu-slots=1", f"--work-dir={work}", "--metrics-addr=",
                f"--allowed-paths=/usr/share,{self.dir}", f"--tls-ca={self.coordinator.ca_file}"]
        self.workers.append(subprocess.Popen(argv, stdout=log, stderr=log))
        log.close()

    # --- the browser -------------------------------------------------------

    def shot(self, name):
        self.browser.save_screenshot(os.path.join(self.shots, f"{name}.png"))

    def text(self, element_id):
        try:
            return self.browser.find_element(By.ID, element_id).text
        except WebDriverException:
            return ""

    def js(self, script):
        return self.browser.execute_script(script)

    def set_token(self, token):
        """Pastes `token` into the page's token form (opening it if needed)."""
        panel = self.browser.find_element(By.ID, "token-panel")
        if not panel.is_displayed():
            self.browser.find_element(By.ID, "token-button").click()
        wait_for(panel.is_displayed, UI_TIMEOUT, "the token form open")
        field = self.browser.find_element(By.ID, "token-input")
        field.clear()
        if token:
            field.send_keys(token)
            self.browser.find_element(By.ID, "token-save").click()
        else:
            self.browser.find_element(By.ID, "token-clear").click()

    def loss_steps(self):
        """The steps the loss chart plots (its first dataset's x values)."""
        return self.js("const c = window.aidnCharts && window.aidnCharts.loss;"
                       "return c ? c.data.datasets[0].data.map(p => p.x) : [];") or []

    def api(self, path, token, method="GET"):
        request = urllib.request.Request(f"{self.url}api/v1/{path}", method=method,
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # --- the tests ---------------------------------------------------------

    def test_a_job_seen_from_submission_through_a_restart_to_its_end(self):
        self.browser.get(self.url)
        # No token yet: the page asks for one and shows nobody's jobs.
        wait_for(lambda: self.browser.find_element(By.ID, "token-panel").is_displayed(),
                 UI_TIMEOUT, "the token form")
        self.shot("01-token-form")
        self.set_token(ALICE)

        job = self.alice.submit(cnn_spec(1500, os.path.join(self.dir, "ckpt")))
        row = f"a[href='#/jobs/{job.id}']"
        wait_for(lambda: self.browser.find_elements(By.CSS_SELECTOR, row), UI_TIMEOUT,
                 "the job in the list")
        wait_for(lambda: "RUNNING" in self.browser.find_element(By.ID, "app").text, UI_TIMEOUT,
                 "RUNNING in the list")
        self.shot("02-job-list")

        self.browser.find_element(By.CSS_SELECTOR, row).click()
        wait_for(lambda: self.text("job-id") == job.id, UI_TIMEOUT, "the job page")

        def step():
            t = self.text("job-step").strip()
            return int(t) if t.isdigit() else 0

        first = wait_for(step, UI_TIMEOUT, "a step on the page")
        wait_for(lambda: step() > first, UI_TIMEOUT, "the step counter to grow")
        points = wait_for(lambda: len(self.loss_steps()), UI_TIMEOUT, "loss points")
        wait_for(lambda: len(self.loss_steps()) > points, UI_TIMEOUT, "more loss points")
        self.assertEqual(self.browser.current_url, self.url + f"#/jobs/{job.id}")
        self.shot("03-job-running")

        # The coordinator restarts under the open page: it reconnects and
        # goes on, plotting no step twice.
        self.coordinator.restart()
        before = step()
        wait_for(lambda: step() > before, UI_TIMEOUT, "steps after the restart")

        wait_for(lambda: self.text("job-state") == "SUCCEEDED", 180, "SUCCEEDED on the page")
        final = self.alice.get(job.id)
        wait_for(lambda: step() == final.last_step, UI_TIMEOUT, "the last step on the page")
        wait_for(lambda: self.loss_steps()[-1:] == [final.last_step], UI_TIMEOUT,
                 "the last step on the loss chart")
        steps = self.loss_steps()
        self.assertEqual(len(steps), len(set(steps)), "a step plotted twice")
        self.assertEqual(steps, sorted(steps))
        self.assertEqual(steps[-1], final.last_step)
        box = self.browser.find_element(By.ID, "chart-loss-box")
        self.assertEqual(int(box.get_attribute("data-points")), len(steps))
        self.assertFalse(self.browser.find_element(By.ID, "cancel-job").is_displayed())
        self.js("window.scrollTo(0, 0)")
        self.shot("04-job-succeeded")
        self.js("window.scrollTo(0, document.body.scrollHeight)")
        self.shot("05-job-succeeded-bottom")
        # A phone's width: the same page, stacked.
        self.browser.set_window_size(412, 915)
        self.js("window.scrollTo(0, 0)")
        self.shot("05-job-succeeded-phone")
        self.assertEqual(self.text("job-state"), "SUCCEEDED")
        self.browser.set_window_size(1280, 1000)

        # The newest checkpoint's weights download as safetensors.
        status, weights = self.api(
            f"jobs/{job.id}/checkpoints/{final.last_checkpoint_step}/model.safetensors", ALICE)
        self.assertEqual(status, 200, weights[:300])
        header = json.loads(weights[8:8 + int.from_bytes(weights[:8], "little")])
        self.assertEqual(header["__metadata__"]["aidn.step"], str(final.last_checkpoint_step))
        self.assertEqual(header["0.weight"]["shape"], [32, 1, 3, 3])
        status, refused = self.api(
            f"jobs/{job.id}/checkpoints/{final.last_checkpoint_step}/model.safetensors", BOB)
        self.assertEqual(status, 403, refused[:300])

        self.browser.get(self.url + "#/cluster")
        wait_for(lambda: "w2" in self.browser.find_element(By.ID, "app").text, UI_TIMEOUT,
                 "the workers")
        self.assertIn("ALIVE", self.browser.find_element(By.ID, "app").text)
        self.shot("06-cluster")

    def test_pause_resume_and_cancel_from_the_page_and_nothing_of_anothers(self):
        job = self.alice.submit(cnn_spec(100000, os.path.join(self.dir, "ckpt")))
        wait_for(lambda: self.alice.get(job.id).last_step > 0, UI_TIMEOUT, "training")

        # Bob sees none of Alice's jobs, and cannot change them.
        self.browser.get(self.url)
        # Without a token the page opens the token form itself.
        wait_for(lambda: self.browser.find_element(By.ID, "token-panel").is_displayed(),
                 UI_TIMEOUT, "the token form")
        self.set_token(BOB)
        wait_for(lambda: "No jobs" in self.browser.find_element(By.ID, "app").text
                 or "0 running" in self.browser.find_element(By.ID, "app").text,
                 UI_TIMEOUT, "bob's empty job list")
        self.assertNotIn(job.id, self.browser.find_element(By.ID, "app").text)
        self.browser.get(self.url + f"#/jobs/{job.id}")
        wait_for(lambda: "alice" in self.browser.find_element(By.ID, "app").text.lower()
                 or "not allowed" in self.browser.find_element(By.ID, "app").text.lower()
                 or "permission" in self.browser.find_element(By.ID, "app").text.lower(),
                 UI_TIMEOUT, "the refusal")
        self.assertEqual(self.text("job-step"), "")
        self.shot("07-another-users-job")
        status, _ = self.api(f"jobs/{job.id}/cancel", BOB, method="POST")
        self.assertEqual(status, 403)
        status, _ = self.api("jobs", "")
        self.assertEqual(status, 401)

        # Alice pauses it, resumes it and cancels it from its page, each
        # confirmed; a dismissed confirmation changes nothing.
        self.set_token(ALICE)
        self.browser.get(self.url + f"#/jobs/{job.id}")
        self.browser.refresh()
        self.click_and_confirm("cancel-job", job.id, accept=False)
        self.click_and_confirm("pause-job", job.id)
        wait_for(lambda: self.text("job-state") == "PAUSED", 120, "PAUSED")
        self.assertGreater(self.alice.get(job.id).last_checkpoint_step, 0)
        self.shot("08-job-paused")
        self.click_and_confirm("resume-job", job.id)
        wait_for(lambda: self.text("job-state") == "RUNNING", UI_TIMEOUT, "RUNNING again")
        self.click_and_confirm("cancel-job", job.id)
        wait_for(lambda: self.text("job-state") == "CANCELLED", UI_TIMEOUT, "CANCELLED")
        self.assertEqual(self.alice.get(job.id).state, 7)  # Job.CANCELLED
        self.shot("09-job-cancelled")

    def click_and_confirm(self, button_id, job_id, accept=True):
        button = wait_for(lambda: [b for b in self.browser.find_elements(By.ID, button_id)
                                   if b.is_displayed() and b.is_enabled()], UI_TIMEOUT,
                          button_id)[0]
        button.click()
        alert = wait_for(lambda: self.alert(), UI_TIMEOUT, "the confirmation")
        self.assertIn(job_id, alert.text)
        if accept:
            alert.accept()
        else:
            alert.dismiss()
            self.assertNotIn(self.alice.get(job_id).state, (7, 8))  # not CANCELLED, PAUSED

    def alert(self):
        try:
            return self.browser.switch_to.alert
        except NoAlertPresentException:
            return None


class WebFlagsTest(unittest.TestCase):
    """The web UI's address and TLS flags, without a browser."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="aidn-webflags-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_off_loopback_it_wants_https(self):
        argv = [binary("AIDN_COORDINATOR_BIN"), "--listen=127.0.0.1:0",
                f"--state-dir={self.dir}/state", "--metrics-addr=", "--web-addr=0.0.0.0:0"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--web-addr 0.0.0.0:0 is not a loopback address", result.stderr)
        self.assertIn("--web-tls", result.stderr)
        result = subprocess.run(argv[:-1] + ["--insecure", "--web-tls", "--web-addr=127.0.0.1:0"],
                                capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--web-tls serves the web UI with the gRPC certificate", result.stderr)

    def test_over_https_with_the_coordinators_certificate(self):
        port = free_port()
        coordinator = Coordinator(os.path.join(self.dir, "state"),
                                  ["--web-tls", f"--web-addr=127.0.0.1:{port}"])
        coordinator.start()
        self.addCleanup(coordinator.stop)
        import ssl
        context = ssl.create_default_context(cafile=coordinator.ca_file)
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/", context=context,
                                    timeout=30) as r:
            self.assertEqual(r.status, 200)
            self.assertIn(b"/app.js", r.read())
        request = urllib.request.Request(f"https://127.0.0.1:{port}/api/v1/workers",
                                         headers={"Authorization":
                                                  f"Bearer {coordinator.admin_token}"})
        with urllib.request.urlopen(request, context=context, timeout=30) as r:
            self.assertEqual(json.loads(r.read()), {"workers": []})
        with self.assertRaises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"https://127.0.0.1:{port}/api/v1/workers", context=context,
                                   timeout=30)
        self.assertEqual(refused.exception.code, 401)


if __name__ == "__main__":
    unittest.main()
