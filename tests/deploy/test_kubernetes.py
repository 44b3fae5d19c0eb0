"""deploy/kubernetes without a cluster: every manifest and the Secrets
make-secrets.sh writes match the Kubernetes API's object models
(k8s_schema), the flags the containers pass are the binaries' own, and the
TLS material and tokens of those Secrets start a coordinator that a worker
joins and the probe command finds healthy."""

import base64
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from aidn_testing import START_TIMEOUT, binary, read_addr_file, wait_for

SOURCE = os.environ.get("AIDN_SOURCE_DIR", "")
BINARY_ENV = {"aidn-coordinator": "AIDN_COORDINATOR_BIN", "aidn-worker": "AIDN_WORKER_BIN",
              # the same program as aidn-worker, built only with CUDA
              "aidn-worker-gpu": "AIDN_WORKER_BIN", "aidnctl": "AIDN_AIDNCTL_BIN"}


def kube_dir():
    return os.path.join(SOURCE, "deploy", "kubernetes")


def manifests():
    """(file, document) for every resource kustomization.yaml lists."""
    with open(os.path.join(kube_dir(), "kustomization.yaml")) as f:
        resources = yaml.safe_load(f)["resources"]
    docs = []
    for name in resources:
        with open(os.path.join(kube_dir(), name)) as f:
            docs += [(name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def containers(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def flag_names(args):
    return [re.sub(r"=.*", "", a)[2:].replace("-", "_") for a in args if a.startswith("--")]


class KubernetesManifestsTest(unittest.TestCase):
    def setUp(self):
        if not SOURCE:
            self.skipTest("AIDN_SOURCE_DIR is not set")
        try:
            import k8s_schema  # noqa: F401  (python3-kubernetes)
        except ImportError:
            self.skipTest("python3-kubernetes is not installed")
        self.dir = tempfile.mkdtemp(prefix="aidn-k8s-test.")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def make_secrets(self):
        subprocess.run([os.path.join(kube_dir(), "make-secrets.sh"), self.dir], check=True,
                       capture_output=True, timeout=60)
        with open(os.path.join(self.dir, "secrets.yaml")) as f:
            return {d["metadata"]["name"]: d for d in yaml.safe_load_all(f)}

    def test_every_document_matches_the_api(self):
        import k8s_schema
        docs = manifests() + [("secrets.yaml", d) for d in self.make_secrets().values()]
        kinds = sorted({d["kind"] for _, d in docs})
        self.assertEqual(kinds, ["DaemonSet", "Namespace", "Secret", "Service", "StatefulSet"])
        for name, doc in docs:
            self.assertEqual(k8s_schema.check_document(doc), [], name)
        listed = {n for n, _ in manifests()} | {"kustomization.yaml"}
        on_disk = {n for n in os.listdir(kube_dir()) if n.endswith(".yaml")}
        self.assertEqual(on_disk, listed, "kustomization.yaml lists every manifest")

    def test_a_misspelt_or_mistyped_field_is_caught(self):
        import k8s_schema
        _, statefulset = next((n, d) for n, d in manifests() if d["kind"] == "StatefulSet")
        container = containers(statefulset)[0]
        container["readinesProbe"] = container.pop("readinessProbe")
        container["ports"][0]["containerPort"] = "7070"
        problems = "\n".join(k8s_schema.check_document(statefulset))
        self.assertIn("unknown field 'readinesProbe' in V1Container", problems)
        self.assertIn("containerPort: int expected, got '7070'", problems)

    def test_references_hold_together(self):
        docs = manifests()
        secrets = set(self.make_secrets())
        services = [d for _, d in docs if d["kind"] == "Service"]
        for _, doc in docs:
            if doc["kind"] not in ("StatefulSet", "DaemonSet"):
                continue
            name = doc["metadata"]["name"]
            spec = doc["spec"]
            labels = spec["template"]["metadata"]["labels"]
            for k, v in spec["selector"]["matchLabels"].items():
                self.assertEqual(labels.get(k), v, f"{name}: the selector matches its pods")
            annotations = spec["template"]["metadata"].get("annotations", {})
            self.assertEqual(annotations.get("prometheus.io/scrape"), "true", name)
            volumes = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
            claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
            for v in volumes.values():
                if "secret" in v:
                    self.assertIn(v["secret"]["secretName"], secrets, f"{name}: {v['name']}")
            for c in containers(doc):
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                self.assertEqual(str(ports.get("metrics")),
                                 annotations.get("prometheus.io/port"), name)
                for probe in ("readinessProbe", "livenessProbe"):
                    self.assertIn(probe, c, f"{name}/{c['name']}")
                self.assertIn("limits", c.get("resources", {}), f"{name}/{c['name']}")
                self.assertFalse(c["securityContext"]["allowPrivilegeEscalation"])
                for m in c.get("volumeMounts", []):
                    self.assertIn(m["name"], set(volumes) | claims, f"{name}: {m['name']}")
        for service in services:
            selected = [d for _, d in docs if d["kind"] == "StatefulSet" and all(
                d["spec"]["template"]["metadata"]["labels"].get(k) == v
                for k, v in service["spec"]["selector"].items())]
            self.assertEqual(len(selected), 1, service["metadata"]["name"])

    def test_containers_pass_only_flags_their_binaries_know(self):
        known = {}
        for program, env in BINARY_ENV.items():
            if program == "aidnctl":
                continue
            out = subprocess.run([binary(env), "--helpfull"], capture_output=True, text=True,
                                 timeout=60).stdout
            known[program] = set(re.findall(r"^\s+--([a-z_0-9]+)", out, re.M))
            self.assertIn("listen" if program == "aidn-coordinator" else "coordinator",
                          known[program])
        for name, doc in manifests():
            for c in containers(doc):
                program = c["command"][0]
                self.assertIn(program, known, f"{name}: runs {program}")
                unknown = set(flag_names(c["args"])) - known[program]
                self.assertEqual(unknown, set(), f"{name}: flags {program} does not know")

    def test_the_secrets_start_a_coordinator_a_worker_joins_and_the_probe_passes(self):
        secrets = self.make_secrets()
        files = {}
        for secret in secrets.values():
            for key, value in secret["data"].items():
                path = os.path.join(self.dir, f"{secret['metadata']['name']}.{key}")
                with open(path, "wb") as f:
                    f.write(base64.b64decode(value))
                files[f"{secret['metadata']['name']}/{key}"] = path
        _, statefulset = next((n, d) for n, d in manifests() if d["kind"] == "StatefulSet")
        coordinator = containers(statefulset)[0]
        # The manifest's mount paths, mapped onto the files written here.
        mounts = {"/etc/aidn/tls/": "aidn-tls/", "/etc/aidn/tokens/": "aidn-tokens/"}

        def local(arg):
            for mount, secret in mounts.items():
                if mount in arg:
                    key = arg.split(mount, 1)[1]
                    return arg.split(mount, 1)[0] + files[secret + key]
            return arg

        state = os.path.join(self.dir, "state")
        addr_file = os.path.join(self.dir, "addr")
        args = [local(a) for a in coordinator["args"]
                if not a.startswith(("--listen", "--state-dir", "--metrics-addr"))]
        log = open(os.path.join(self.dir, "coordinator.log"), "wb")
        process = subprocess.Popen(
            [binary("AIDN_COORDINATOR_BIN")] + args +
            [f"--state-dir={state}", "--listen=127.0.0.1:0", f"--addr-file={addr_file}",
             "--metrics-addr="], stdout=log, stderr=log)
        log.close()
        self.addCleanup(lambda: (process.poll() is None and process.kill(), process.wait()))

        def address():
            if process.poll() is not None:
                with open(os.path.join(self.dir, "coordinator.log")) as f:
                    raise AssertionError(f"the coordinator exited:\n{f.read()[-3000:]}")
            return read_addr_file(addr_file)

        addr = wait_for(address, START_TIMEOUT, "the coordinator to serve")
        port = addr.rsplit(":", 1)[1]
        probe = [local(a).replace("127.0.0.1:7070", f"127.0.0.1:{port}")
                 for a in coordinator["readinessProbe"]["exec"]["command"]]
        probe[0] = binary("AIDN_AIDNCTL_BIN")
        result = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        self.assertEqual((result.returncode, result.stdout.strip()), (0, "SERVING"),
                         result.stderr)
        # A named service: aidn's own, and one the coordinator does not serve.
        named = subprocess.run(probe + ["aidn.v1.CoordinatorService"], capture_output=True,
                               text=True, timeout=60)
        self.assertEqual((named.returncode, named.stdout.strip()), (0, "SERVING"), named.stderr)
        unknown = subprocess.run(probe + ["no.such.Service"], capture_output=True, text=True,
                                 timeout=60)
        self.assertEqual((unknown.returncode, unknown.stdout.strip()), (1, "SERVICE_UNKNOWN"))
        self.assertIn("is SERVICE_UNKNOWN for no.such.Service", unknown.stderr)

        worker_dir = os.path.join(self.dir, "worker")
        wlog = open(os.path.join(self.dir, "worker.log"), "wb")
        worker = subprocess.Popen(
            [binary("AIDN_WORKER_BIN"), f"--coordinator=127.0.0.1:{port}",
             f"--tls-ca={files['aidn-tls/ca.crt']}",
             f"--token-file={files['aidn-worker-token/token']}", "--worker-id=pod-1",
             f"--work-dir={worker_dir}", "--metrics-addr="], stdout=wlog, stderr=wlog)
        wlog.close()
        self.addCleanup(lambda: (worker.poll() is None and worker.kill(), worker.wait()))
        with open(os.path.join(self.dir, "admin.token")) as f:
            admin = f.read().strip()
        ctl = [binary("AIDN_AIDNCTL_BIN"), f"--addr=127.0.0.1:{port}",
               f"--tls-ca={os.path.join(self.dir, 'ca.crt')}", f"--token={admin}"]

        def joined():
            self.assertIsNone(worker.poll(), "the worker exited")
            out = subprocess.run(ctl + ["workers"], capture_output=True, text=True, timeout=60)
            return re.search(r"^pod-1\s+\S+\s+ALIVE", out.stdout, re.M)

        wait_for(joined, START_TIMEOUT, "the worker to join with the Secret's token",
                 interval=0.3)

        process.terminate()
        process.wait(timeout=30)
        down = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(down.returncode, 0, "the probe fails once the coordinator is gone")

    def test_kubectl_renders_the_kustomization_offline(self):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed (Debian's kubernetes-client)")
        result = subprocess.run([kubectl, "kustomize", kube_dir()], capture_output=True,
                                text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
        self.assertEqual(sorted((d["kind"], d["metadata"]["name"]) for d in rendered),
                         sorted((d["kind"], d["metadata"]["name"]) for _, d in manifests()))


if __name__ == "__main__":
    unittest.main()
