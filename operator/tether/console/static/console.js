// The console's only script: it keeps the server-rendered page live. The server pushes fragments
// and rows over one EventSource; this swaps them in, ticks ages, and posts the user's actions.
"use strict";

const body = document.body;
const flash = document.getElementById("flash");
let source = null;

function say(text, bad) {
  flash.textContent = text;
  flash.className = bad ? "error" : "ok";
}

// Inputs a swap would wipe (a reason being typed) keep their value across it, within the same run:
// a reason typed for one run never reappears under a namesake's form.
function formKey(f) {
  return [f.dataset.action, f.dataset.uid, f.dataset.gate, f.dataset.attempt].join("|");
}

function swap(el, html) {
  const kept = {};
  el.querySelectorAll("form[data-action]").forEach((f) => { kept[formKey(f)] = f.elements.reason.value; });
  el.innerHTML = html;
  el.querySelectorAll("form[data-action]").forEach((f) => {
    const value = kept[formKey(f)];
    if (value) f.elements.reason.value = value;
  });
  tick();
}

function upsertRow(tbody, key, html) {
  const tpl = document.createElement("template");
  tpl.innerHTML = html.trim();
  const row = tpl.content.firstElementChild;
  const old = tbody.querySelector(`tr[data-key="${CSS.escape(key)}"]`);
  if (old) { old.replaceWith(row); return; }
  const after = [...tbody.children].find((tr) => tr.dataset.key > key);
  tbody.insertBefore(row, after || null);
}

function showEmpty() {
  const rows = document.getElementById("rows");
  const empty = document.getElementById("empty");
  if (rows && empty) empty.hidden = rows.children.length > 0;
}

function connect(url) {
  if (source) source.close();
  source = new EventSource(url);
  const live = document.getElementById("live");
  source.onopen = () => live.classList.add("on");
  source.onerror = () => {
    live.classList.remove("on");
    // Closed, not retrying: the server refused the stream (signed out, token expired, too many
    // users). Loading the page again shows why, or the sign-in page.
    if (source.readyState === EventSource.CLOSED) location.reload();
  };
  source.addEventListener("fragments", (e) => {
    for (const [id, html] of Object.entries(JSON.parse(e.data))) {
      const el = document.getElementById(id);
      if (el) swap(el, html);
    }
  });
  source.addEventListener("reset", (e) => {
    const tbody = document.getElementById("rows");
    tbody.innerHTML = "";
    for (const [key, html] of JSON.parse(e.data)) upsertRow(tbody, key, html);
    showEmpty(); tick();
  });
  source.addEventListener("rows", (e) => {
    const tbody = document.getElementById("rows");
    const change = JSON.parse(e.data);
    for (const key of change.remove) tbody.querySelector(`tr[data-key="${CSS.escape(key)}"]`)?.remove();
    for (const [key, html] of change.upsert) upsertRow(tbody, key, html);
    showEmpty(); tick();
  });
}

// How long ago (s > 0) or ahead (s < 0), the way people say it: "42s ago", "in 59m", "in 3d".
function age(s) {
  const a = Math.abs(s);
  const said = a < 120 ? `${a}s` : a < 7200 ? `${Math.round(a / 60)}m` : a < 172800 ? `${Math.round(a / 3600)}h`
    : `${Math.round(a / 86400)}d`;
  return s < 0 ? `in ${said}` : `${said} ago`;
}

// Ages (lease renewals, requests, deadlines) from the browser's clock: they change every second
// without the objects changing, so the server never sends them again.
function tick() {
  const now = Date.now();
  document.querySelectorAll("[data-since]").forEach((el) => {
    el.textContent = age(Math.round((now - Date.parse(el.dataset.since)) / 1000));
    el.title = el.dataset.since;
  });
}

async function post(url, payload) {
  const resp = await fetch(url, {
    method: "POST", credentials: "same-origin",
    headers: {"X-Tether-Console": "1", "Content-Type": "application/json"},
    body: JSON.stringify(payload || {}),
  });
  const answer = await resp.json().catch(() => ({error: resp.statusText}));
  say(answer.message || answer.error, !resp.ok);
  return resp.ok;
}

// One handler for every gate (Start, Result, a worker's request), wherever its form is shown.
document.addEventListener("submit", async (e) => {
  const form = e.target.closest("form.decide");
  if (!form) return;
  e.preventDefault();
  // Only a click on Approve or Deny decides; any other way of submitting (Enter) does nothing.
  if (!e.submitter || e.submitter.name !== "decision") return;
  const reason = form.elements.reason.value.trim();
  await post(form.dataset.action, {uid: form.dataset.uid, gate: form.dataset.gate,
                                   attempt: Number(form.dataset.attempt), decision: e.submitter.value, reason});
});

// An attempt's logs: plain text from the console's server, shown as text (never as markup).
async function showLogs(button) {
  const title = document.getElementById("log-title");
  const out = document.getElementById("log-output");
  const attempt = button.closest("tr")?.dataset.attempt;
  title.textContent = `attempt ${attempt}: loading…`;
  title.className = "muted";
  let resp, text;
  try {
    resp = await fetch(button.dataset.logs, {credentials: "same-origin"});
    text = await resp.text();
  } catch (err) {
    resp = {ok: false}; text = String(err);
  }
  title.textContent = resp.ok ? `attempt ${attempt}: the last lines of its worker's log` : `attempt ${attempt}: no logs`;
  title.className = resp.ok ? "" : "error";
  out.textContent = resp.ok && !text ? "(the container has written nothing)" : text;
  out.classList.toggle("error", !resp.ok);
  out.hidden = false;
}

document.addEventListener("click", async (e) => {
  const logs = e.target.closest("button[data-logs]");
  if (logs) { await showLogs(logs); return; }
  const button = e.target.closest("button[data-post]");
  if (!button) return;
  if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
  await post(button.dataset.post, {uid: button.dataset.uid});
});

const filters = document.getElementById("filters");
if (filters) {
  filters.addEventListener("change", () => {
    const query = new URLSearchParams();
    for (const [k, v] of new FormData(filters)) if (v) query.set(k, v);
    history.replaceState(null, "", `${location.pathname}${query.size ? "?" + query : ""}`);
    query.set("page", "runs");
    connect(`${body.dataset.events.split("?")[0]}?${query}`);
  });
}

showEmpty();
tick();
setInterval(tick, 1000);
connect(body.dataset.events);
