/**
 * The pod worker's path to the Kubernetes API: @kubernetes/client-node's KubeConfig and API clients,
 * plus what the client does not do for us:
 * - a kubeconfig user's `tokenFile` (the kubelet rotates it): client-node 1.x ignores it and would
 *   call as system:anonymous, so the SDK reads the file itself, on every request;
 * - a per-request timeout (a request unanswered in time counts as no answer);
 * - the status code, body and Retry-After of every refusal, which decide lost vs. unknown.
 */

import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";

import {
  AbortError,
  ApiException,
  CoordinationV1Api,
  CustomObjectsApi,
  FetchError,
  KubeConfig,
  Observable,
  PatchStrategy,
  loadYaml,
  type ConfigurationOptions,
  type ObservableMiddleware,
  type RequestContext,
  type ResponseContext,
  type User,
  type V1Lease,
} from "@kubernetes/client-node";

import { childBody, parentOf, type Parent } from "./children.js";
import { LeaseLost, ResultInvalid, SpawnRefused } from "./errors.js";
import {
  ANN_REQUESTS,
  GROUP,
  PLURAL,
  VERSION,
  fencedByPolicy,
  fencedPatch,
  holds,
  invalidCauses,
  leaseSignals,
  parseLease,
  PUBLICATION_TIMEOUT_SECONDS,
  publicationRecorded,
  refusesValue,
  renewal,
  requestsAnnotation,
  retryAfterSeconds,
  tooLarge,
  type ApprovalRequest,
  type JsonObject,
  type LeaseObject,
  type PublishField,
  type RunObject,
  type Usage,
} from "./protocol.js";
import { Unanswered, confirmed, unconfirmed, type Renewal, type Transport } from "./transport.js";

export const SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount";

/** The payload read's request timeout (docs/protocol.md §4): a large object, read once at start-up,
 * must not be held to T, which is 1 s when R is. */
const PAYLOAD_TIMEOUT_SECONDS = 30;

type Authenticator = Parameters<KubeConfig["addAuthenticator"]>[0];

/**
 * Sends `Authorization: Bearer <token>` read from `tokenFile` on every request, so a token the
 * kubelet rotated (or that a 401 showed stale) is picked up by the very next request.
 */
export class TokenFileAuth implements Authenticator {
  constructor(readonly userName: string, readonly tokenFile: string) {}

  isAuthProvider(user: User): boolean {
    return user.name === this.userName;
  }

  readToken(): string {
    const token = fs.readFileSync(this.tokenFile, "utf8").trim();
    if (!token) throw new Error(`token file ${this.tokenFile} is empty`);
    return token;
  }

  async applyAuthentication(_user: User, opts: { headers?: Record<string, unknown> }): Promise<void> {
    opts.headers = { ...(opts.headers ?? {}), Authorization: `Bearer ${this.readToken()}` };
  }
}

interface RawKubeconfig {
  users?: { name?: string; user?: { tokenFile?: string } }[];
}

/** The `tokenFile` the named user has in the first kubeconfig file that defines it (absolute). */
export function kubeconfigTokenFile(files: string[], userName: string): string | null {
  for (const file of files) {
    const doc = loadYaml<RawKubeconfig>(fs.readFileSync(file, "utf8"));
    const entry = (doc.users ?? []).find((u) => u.name === userName);
    if (entry === undefined) continue;
    const tokenFile = entry.user?.tokenFile;
    return tokenFile ? path.resolve(path.dirname(file), tokenFile) : null;
  }
  return null;
}

export interface KubeConfigSource {
  env?: NodeJS.ProcessEnv;
  /** Where the in-cluster token and CA are mounted (tests point it elsewhere). */
  serviceAccountDir?: string;
}

/**
 * The API server and credentials: in-cluster (service account token and CA) when the token is
 * mounted, KUBERNETES_SERVICE_HOST is set and KUBECONFIG is not; else $KUBECONFIG (or
 * ~/.kube/config). A token file, in-cluster or named by the kubeconfig user, is read per request.
 */
export function loadKubeConfig(source: KubeConfigSource = {}): KubeConfig {
  const env = source.env ?? process.env;
  const saDir = source.serviceAccountDir ?? SERVICE_ACCOUNT_DIR;
  const kc = new KubeConfig();
  const saToken = path.join(saDir, "token");
  const host = env.KUBERNETES_SERVICE_HOST;
  if (!env.KUBECONFIG && host && fs.existsSync(saToken)) {
    const port = env.KUBERNETES_SERVICE_PORT ?? "443";
    const server = `https://${net.isIPv6(host) ? `[${host}]` : host}:${port}`;
    const user = "tether-in-cluster";
    kc.loadFromClusterAndUser(
      { name: "in-cluster", server, caFile: path.join(saDir, "ca.crt"), skipTLSVerify: false }, { name: user });
    kc.addAuthenticator(new TokenFileAuth(user, saToken));
    return kc;
  }
  const files = env.KUBECONFIG
    ? env.KUBECONFIG.split(path.delimiter).filter((f) => f.length > 0)
    : [path.join(os.homedir(), ".kube", "config")].filter((f) => fs.existsSync(f));
  if (files.length === 0) {
    throw new Error("no Kubernetes configuration: no in-cluster service account token, no KUBECONFIG, no ~/.kube/config");
  }
  kc.loadFromFile(files[0] as string);
  for (const file of files.slice(1)) {
    const more = new KubeConfig();
    more.loadFromFile(file);
    kc.mergeConfig(more, Boolean(kc.getCurrentContext()));
  }
  const user = kc.getCurrentUser();
  const tokenFile = user === null ? null : kubeconfigTokenFile(files, user.name);
  if (user !== null && tokenFile !== null) kc.addAuthenticator(new TokenFileAuth(user.name, tokenFile));
  return kc;
}

/** An HTTP answer the API server gave: the parsed object on 2xx, else the status and text. */
type Answer<T> = { ok: true; body: T } | { ok: false; status: number; text: string; headers: Record<string, string> };

function now<T>(value: T): Observable<T> {
  return new Observable(Promise.resolve(value));
}

/** The exact text of an answer, captured before client-node turns it into model classes. */
interface Wire {
  text: string | null;
}

/** A Lease read: the Lease, or what the answer means when it brings none (gone, or unconfirmed). */
type LeaseRead = { lease: LeaseObject } | { verdict: Renewal };

/** How often a child is created again when it was deleted between its create's 409 and the read. */
const SPAWN_TRIES = 3;

/**
 * The pod worker's transport: a resourceVersion-conditional Lease update and a fenced JSON patch on
 * the run's status, through client-node's generated clients.
 */
export class KubeTransport implements Transport {
  private lease: LeaseObject | null = null;
  /** This run as its children name it, read at the first spawn. */
  private parentRun: Parent | null = null;
  private readonly leases: CoordinationV1Api;
  private readonly objects: CustomObjectsApi;

  constructor(
    readonly namespace: string,
    readonly name: string,
    readonly holder: string,
    readonly fence: number,
    readonly runUid: string | null,
    kc: KubeConfig,
    private readonly timeoutSeconds: number,
    private readonly log: (message: string, fields: Record<string, unknown>) => void = () => {},
    // TP (protocol §3): a publication may take longer than the other calls; a test shortens it.
    private readonly publicationTimeoutSeconds: number = PUBLICATION_TIMEOUT_SECONDS,
  ) {
    this.leases = kc.makeApiClient(CoordinationV1Api);
    this.objects = kc.makeApiClient(CustomObjectsApi);
  }

  /**
   * Per-request options. A timeout always: T, unless `timeoutSeconds` says otherwise. For the status
   * patch, its content type, set explicitly: client-node picks the first type the API lists (JSON
   * patch today), but that default has changed between releases, and a merge patch would publish
   * without the `test` operations. For the Lease, the exact JSON both ways (`send`, `wire`):
   * client-node's models drop fields they do not know, and a renewal that drops a spec field is
   * refused by Tether's admission policy (read as lost) or erases it; the Lease is sent back exactly
   * as the API server gave it, renewTime and reports aside.
   */
  private options(opts: { contentType?: string; send?: string; wire?: Wire; timeoutSeconds?: number } = {},
  ): ConfigurationOptions<ObservableMiddleware> {
    const timeoutMs = (opts.timeoutSeconds ?? this.timeoutSeconds) * 1000;
    const middleware: ObservableMiddleware = {
      pre: (ctx: RequestContext) => {
        ctx.setSignal(AbortSignal.timeout(timeoutMs));
        if (opts.contentType) ctx.setHeaderParam("Content-Type", opts.contentType);
        if (opts.send !== undefined) ctx.setBody(opts.send);
        return now(ctx);
      },
      post: (rsp: ResponseContext) => {
        const wire = opts.wire;
        if (wire === undefined) return now(rsp);
        return new Observable(rsp.body.text().then((text) => {
          wire.text = text;
          // The protocol reads a success from the text (parseLease): client-node must not refuse an
          // answer first (a proxy's page, JSON of another shape), which says nothing about ownership.
          if (rsp.httpStatusCode >= 200 && rsp.httpStatusCode < 300) rsp.headers["content-type"] = "text/plain";
          rsp.body = { text: async () => text, binary: async () => Buffer.from(text) };
          return rsp;
        }));
      },
    };
    return { middleware: [middleware], middlewareMergeStrategy: "append" };
  }

  private async call<T>(what: string, send: () => Promise<T>): Promise<Answer<T>> {
    try {
      return { ok: true, body: await send() };
    } catch (err) {
      if (err instanceof ApiException) {
        const apiErr = err as ApiException<unknown>;
        const text = typeof apiErr.body === "string" ? apiErr.body : apiErr.body === undefined ? "" : JSON.stringify(apiErr.body);
        if (apiErr.code === 401) {
          // The token file is read again for the next request (TokenFileAuth reads it every time).
          this.log("the API server did not accept the token", { event: "unauthorized", request: what });
        }
        return { ok: false, status: apiErr.code, text, headers: apiErr.headers ?? {} };
      }
      if (err instanceof AbortError || err instanceof FetchError) {
        throw new Unanswered(`${what}: no answer: ${err.message}`, null, 0, { cause: err });
      }
      throw err;
    }
  }

  private async getLease(what: string): Promise<LeaseRead> {
    const wire: Wire = { text: null };
    const answer = await this.call("GET lease", () =>
      this.leases.readNamespacedLease({ name: this.name, namespace: this.namespace }, this.options({ wire })));
    if (!answer.ok) {
      return { verdict: answer.status === 404 ? unconfirmed("the lease is gone", true)
        : unconfirmed(`${what} refused: ${answer.status} ${answer.text.slice(0, 200)}`) };
    }
    const lease = parseLease(wire.text ?? "");
    return lease !== null ? { lease } : { verdict: notALease(what, wire) };
  }

  private isMine(lease: LeaseObject | null): boolean {
    return holds(lease, this.holder, this.fence, this.runUid);
  }

  async renew(checkpoint: string | null, usage: Usage | null,
    requests: readonly ApprovalRequest[] = []): Promise<Renewal> {
    return this.renewOnce(checkpoint, usage, requests, true);
  }

  private async renewOnce(checkpoint: string | null, usage: Usage | null, requests: readonly ApprovalRequest[],
    retryConflict: boolean): Promise<Renewal> {
    if (this.lease === null) {
      const read = await this.getLease("the lease read");
      if ("verdict" in read) return read.verdict;
      this.lease = read.lease;
    }
    if (!this.isMine(this.lease)) return unconfirmed("the lease names another holder or fence", true);
    // No requests, no annotation: a worker that asks for nothing writes what it always did.
    const asked: Record<string, string> = requests.length > 0
      ? { [ANN_REQUESTS]: requestsAnnotation(requests) } : {};
    const body = renewal(this.lease, new Date(), checkpoint, usage, asked);
    const wire: Wire = { text: null };
    const put = await this.call("PUT lease", () => this.leases.replaceNamespacedLease(
      { name: this.name, namespace: this.namespace, body: body as V1Lease }, this.options({ send: JSON.stringify(body), wire })));
    if (put.ok) {
      const renewed = parseLease(wire.text ?? "");
      // Not the answer to this renewal (a proxy's page, a Status): it confirms nothing and denies
      // nothing. The last Lease stays; if this PUT landed, the next one conflicts and re-reads.
      if (renewed === null || !this.isMine(renewed)) return notALease("the renewal", wire);
      this.lease = renewed;
      return confirmed(leaseSignals(renewed));
    }
    if (put.status === 409) {
      // Re-read: still our holder and fence means someone touched the Lease harmlessly (the
      // operator writing the signals); retry once.
      const read = await this.getLease("the lease re-read");
      if ("verdict" in read) {
        this.lease = null;
        return read.verdict;
      }
      this.lease = read.lease;
      if (!this.isMine(this.lease)) return unconfirmed("renewal conflicted and the lease is no longer ours", true);
      if (retryConflict) return this.renewOnce(checkpoint, usage, requests, false);
      return unconfirmed("renewal conflicted twice");
    }
    if (put.status === 404) return unconfirmed("the lease is gone", true);
    if (fencedByPolicy(put.status, put.text)) {
      return unconfirmed(`the API server's fencing policy refused: ${put.text.slice(0, 200)}`, true);
    }
    return unconfirmed(`renewal refused: ${put.status} ${put.text.slice(0, 200)}`);
  }

  private runRequest() {
    return { group: GROUP, version: VERSION, namespace: this.namespace, plural: PLURAL, name: this.name };
  }

  async publish(field: PublishField, value: unknown): Promise<boolean> {
    const patch = fencedPatch(this.holder, this.fence, field, value, this.runUid);
    const answer = await this.call("PATCH status", () => this.objects.patchNamespacedCustomObjectStatus(
      { ...this.runRequest(), body: patch },
      this.options({ contentType: PatchStrategy.JsonPatch, timeoutSeconds: this.publicationTimeoutSeconds })));
    if (answer.ok) return true;
    if (tooLarge(answer.status, answer.text)) { // 413, or etcd's 500: never stored, however often sent
      throw new ResultInvalid(`the ${field} is too large: ${statusMessage(answer.text)}`);
    }
    if (answer.status === 422) {
      const causes = invalidCauses(answer.text);
      if (refusesValue(causes, field)) {
        throw new ResultInvalid(`the API server refused the ${field}: ${statusMessage(answer.text)}`, causes);
      }
      return false; // a `test` failed: the run's uid, fence or holder moved on
    }
    if (answer.status === 404 || answer.status === 409 || fencedByPolicy(answer.status, answer.text)) return false;
    throw new Unanswered(`PATCH status answered ${answer.status}: ${answer.text.slice(0, 200)}`, answer.status,
      retryAfterSeconds(answer.headers["retry-after"]));
  }

  /** A WorkerRun of this namespace as served now; null when there is none. */
  private async readRun(name: string, timeoutSeconds?: number): Promise<RunObject | null> {
    const answer = await this.call("GET run", () => this.objects.getNamespacedCustomObject({ ...this.runRequest(), name },
      this.options({ timeoutSeconds })));
    if (answer.ok) return answer.body as RunObject;
    if (answer.status === 404) return null;
    throw new Unanswered(`GET run answered ${answer.status}`, answer.status, retryAfterSeconds(answer.headers["retry-after"]));
  }

  async recorded(field: PublishField, value: unknown): Promise<boolean> {
    const run = await this.readRun(this.name, this.publicationTimeoutSeconds);
    if (run === null) return false;
    if (this.runUid !== null && run.metadata?.uid !== this.runUid) return false;
    return publicationRecorded(run, this.holder, this.fence, field, value);
  }

  /**
   * The run's payload when it was too large for the environment (TETHER_PAYLOAD_FROM=spec.payload):
   * read from the pod's own WorkerRun with its own credentials, retrying a brief API hiccup.
   */
  async readPayload(attempts = 3, backoffSeconds = 1): Promise<JsonObject> {
    for (let attempt = 1; ; attempt++) {
      let why: string;
      try {
        const answer = await this.call("GET run", () => this.objects.getNamespacedCustomObject(this.runRequest(),
          this.options({ timeoutSeconds: PAYLOAD_TIMEOUT_SECONDS })));
        if (answer.ok) {
          const run = answer.body as RunObject & { spec?: { payload?: JsonObject } };
          if (this.runUid !== null && run.metadata?.uid !== this.runUid) {
            throw new LeaseLost(`${this.name} was re-created (uid ${this.runUid} is gone)`);
          }
          return run.spec?.payload ?? {};
        }
        why = `GET run answered ${answer.status}: ${answer.text.slice(0, 200)}`;
        if (answer.status < 500) throw new Error(why); // 403/404 will not heal: the attempt fails and says why
      } catch (err) {
        if (!(err instanceof Unanswered)) throw err;
        why = err.message;
      }
      if (attempt >= attempts) throw new Error(`could not read the payload: ${why}`);
      await new Promise((resolve) => setTimeout(resolve, backoffSeconds * 1000 * 2 ** (attempt - 1)));
    }
  }

  /** This run as its children name it: read from the run itself once, with what it took from its class. */
  async parent(): Promise<Parent> {
    if (this.parentRun === null) {
      const run = await this.readRun(this.name);
      if (run === null) throw new LeaseLost(`run ${this.namespace}/${this.name} is gone`);
      this.parentRun = parentOf(run);
    }
    return this.parentRun;
  }

  /**
   * Creates the child with this pod's credentials (the API server's policies let it create only a
   * child of the run it holds, as the attempt it is), or reads the run of that name that exists: 409,
   * then a read (gone meanwhile: created again, SPAWN_TRIES times in all). Throws SpawnRefused for
   * the API server's refusal (400, 403, 422) and `Unanswered` for any other answer.
   */
  async spawn(key: string, generation: number, spec: JsonObject): Promise<RunObject> {
    const body = childBody(await this.parent(), this.namespace, this.holder, this.fence, key, generation, spec);
    const name = body.metadata.name;
    for (let tries = 0; tries < SPAWN_TRIES; tries++) {
      const answer = await this.call("POST run", () => this.objects.createNamespacedCustomObjectWithHttpInfo(
        { group: GROUP, version: VERSION, namespace: this.namespace, plural: PLURAL, body }, this.options()));
      if (answer.ok) {
        if (answer.body.httpStatusCode === 201) return answer.body.data as RunObject;
        throw new Unanswered(`POST run answered ${answer.body.httpStatusCode}`, answer.body.httpStatusCode);
      }
      if ([400, 403, 422].includes(answer.status)) {
        throw new SpawnRefused(`the API server refused child run ${name}: ${statusMessage(answer.text)}`);
      }
      if (answer.status !== 409) {
        throw new Unanswered(`POST run answered ${answer.status}: ${answer.text.slice(0, 200)}`, answer.status,
          retryAfterSeconds(answer.headers["retry-after"]));
      }
      const got = await this.readRun(name);
      if (got !== null) return got; // made before: whose and for what, the caller judges
    }
    throw new SpawnRefused(`child run ${name} kept being deleted as it was made`);
  }

  async child(name: string): Promise<RunObject | null> {
    return this.readRun(name);
  }

  async close(): Promise<void> {}
}

function notALease(what: string, wire: Wire): Renewal {
  return unconfirmed(`${what} answered without this attempt's Lease: ${(wire.text ?? "").slice(0, 200)}`);
}

function statusMessage(text: string): string {
  try {
    const doc: unknown = JSON.parse(text);
    if (typeof doc === "object" && doc !== null && "message" in doc) return String(doc.message).slice(0, 500);
  } catch {
    // not a Status object: show the text
  }
  return text.slice(0, 500);
}
