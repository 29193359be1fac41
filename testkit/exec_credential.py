"""An exec credential plugin for the test cluster, as EKS's or GKE's would be for theirs: prints an
ExecCredential with a fresh ServiceAccount token each time kubectl (or Tether) runs it.

Configured by environment (a kubeconfig's `exec.env`): EXEC_ADMIN_KUBECONFIG (how it asks for
tokens), EXEC_NAMESPACE and EXEC_SERVICE_ACCOUNT (whose tokens; a pod's own when bound to it), EXEC_BIND (`secret`: each token is
bound to a Secret of its own, so deleting it revokes the token; `pod`: bound to the pod named by
$HOSTNAME, as the kubelet binds a worker's token), EXEC_EXPIRES_IN (seconds the credential says it
lives; the token itself lives an hour) and EXEC_LOG (one JSON line per credential given:
its number, the token, its JTI, the Secret that revokes it).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import sys
from pathlib import Path

from tether.kube import config


def jti(token: str) -> str:
    payload = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"])


def main() -> int:
    env = os.environ
    log = Path(env["EXEC_LOG"])
    number = len(log.read_text().splitlines()) if log.exists() else 0
    ns, sa = env["EXEC_NAMESPACE"], env["EXEC_SERVICE_ACCOUNT"]
    secret = None
    with config.load(env["EXEC_ADMIN_KUBECONFIG"]).sync_client() as admin:
        if env.get("EXEC_BIND", "secret") == "pod":
            pod = admin.get(f"/api/v1/namespaces/{ns}/pods/{env['HOSTNAME']}").json()
            bound = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
            sa = pod["spec"].get("serviceAccountName") or "default"  # a pod-bound token is its own account's
        else:
            secret = f"cred-{sa}-{number}"
            made = admin.post(f"/api/v1/namespaces/{ns}/secrets", json={"metadata": {"name": secret}}).json()
            bound = {"kind": "Secret", "apiVersion": "v1", "name": secret, "uid": made["metadata"]["uid"]}
        resp = admin.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                          json={"spec": {"expirationSeconds": 3600, "boundObjectRef": bound}})
    if resp.status_code != 201:
        print(f"token request refused: {resp.status_code} {resp.text}", file=sys.stderr)
        return 1
    token = resp.json()["status"]["token"]
    expires = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=float(env.get("EXEC_EXPIRES_IN", 3600)))
    with log.open("a") as out:
        out.write(json.dumps({"number": number, "token": token, "jti": jti(token), "secret": secret}) + "\n")
    print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                      "status": {"token": token, "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
