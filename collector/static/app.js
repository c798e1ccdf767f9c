// The collector's web page: plain JS over the read API (/v1/view/...), hash routes, no build step.
"use strict";

const app = document.getElementById("app");

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function num(value, digits = 3) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleString() : "–";
}

async function api(path) {
  const response = await fetch(path);
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    const error = new Error(`${response.status} ${body.error || ""}: ${body.message || response.statusText}`);
    throw Object.assign(error, { code: body.error });
  }
  return response.json();
}

// The steps to label on an axis from x0 to x1 drawn `width` pixels wide: the multiples of the smallest stride of
// 1, 2, 5, 10, 20, 50, … that leaves each label (`chars` digits at 11px) room before the next one.
function stepTicks(x0, x1, width, chars) {
  const room = chars * 11 * 0.7 + 8; // wider than any font's digits at 11px, and a gap
  let stride = 1;
  for (let k = 1; x1 > x0 && (stride * width) / (x1 - x0) < room; k += 1) stride = [1, 2, 5][k % 3] * 10 ** Math.floor(k / 3);
  const ticks = [];
  for (let s = Math.ceil(x0 / stride) * stride; s <= x1; s += stride) ticks.push(s);
  return ticks;
}

function curveSvg(points) {
  if (!points.length) return '<p class="muted">No rewarded trajectories with a policy step yet.</p>';
  const w = 640, h = 220, pad = 36;
  const steps = points.map((p) => p.policy_step);
  const lo = Math.min(0, ...points.map((p) => p.min)), hi = Math.max(1, ...points.map((p) => p.max));
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  const x = (s) => pad + (x1 === x0 ? (w - 2 * pad) / 2 : ((s - x0) / (x1 - x0)) * (w - 2 * pad));
  const y = (v) => h - pad - ((v - lo) / (hi - lo || 1)) * (h - 2 * pad);
  const line = points.map((p, i) => `${i ? "L" : "M"}${x(p.policy_step).toFixed(1)},${y(p.mean).toFixed(1)}`).join(" ");
  const dots = points
    .map((p) => `<circle cx="${x(p.policy_step)}" cy="${y(p.mean)}" r="3.5" fill="#3b82f6"><title>step ${p.policy_step}: mean ${num(p.mean)} (n=${p.count})</title></circle>`)
    .join("");
  const chars = Math.max(String(x0).length, String(x1).length);
  const ticks = stepTicks(x0, x1, w - 2 * pad, chars)
    .map((s) => `<text x="${x(s)}" y="${h - pad + 16}" font-size="11" text-anchor="middle">${s}</text>`)
    .join("");
  return `<svg class="curve" id="reward-curve" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}" role="img" aria-label="mean reward per policy step">
    <line x1="${pad}" y1="${h - pad}" x2="${w - pad}" y2="${h - pad}" stroke="#999"/>
    <line x1="${pad}" y1="${pad}" x2="${pad}" y2="${h - pad}" stroke="#999"/>
    <text x="${pad - 6}" y="${y(hi) + 4}" font-size="11" text-anchor="end">${num(hi, 2)}</text>
    <text x="${pad - 6}" y="${y(lo) + 4}" font-size="11" text-anchor="end">${num(lo, 2)}</text>
    <text x="${w / 2}" y="${h - 4}" font-size="11" text-anchor="middle">policy step</text>
    <path d="${line}" fill="none" stroke="#3b82f6" stroke-width="2"/>${dots}${ticks}</svg>`;
}

function groupLink(t) {
  if (!t.group_id) return `<span class="muted">${esc(t.ungrouped)}</span>`;
  return `<a href="#/?group=${encodeURIComponent(t.group_id)}">${esc(t.group_id)}</a>`;
}

const PAGE_SIZE = 100; // trajectories per page of the list; newest groups on the groups page

// Where this page of the list lies, with links to the pages before and after it (the list's own filters kept).
function pageLinks(query, shown, total) {
  if (!total) return "";
  const offset = Number(query.get("offset")), limit = Number(query.get("limit"));
  const at = (start) => {
    const moved = new URLSearchParams(query);
    moved.set("offset", start);
    return `#/?${moved}`;
  };
  const newer = offset > 0 ? ` <a id="newer" href="${esc(at(Math.max(0, offset - limit)))}">← newer</a>` : "";
  const older = offset + shown < total ? ` <a id="older" href="${esc(at(offset + limit))}">older →</a>` : "";
  const range = shown ? `${offset + 1}–${offset + shown} of ${total}` : `none past ${offset} of ${total}`;
  return `<p id="pages">${range}${newer}${older}</p>`;
}

async function trajectoriesView(params) {
  const query = new URLSearchParams({ limit: PAGE_SIZE, offset: 0 });
  for (const [key, value] of params) if (value !== "") query.set(key, value);
  const [page, curve] = await Promise.all([api(`/v1/view/trajectories?${query}`), api("/v1/view/reward-curve")]);
  const field = (name, label) => `<label>${label} <input name="${name}" value="${esc(params.get(name) || "")}"></label>`;
  const rows = page.items
    .map(
      (t) => `<tr class="trajectory-row" data-id="${esc(t.id)}">
      <td><a href="#/t/${encodeURIComponent(t.id)}">${esc(t.id)}</a></td><td>${esc(t.task)}</td>
      <td>${groupLink(t)}</td>
      <td class="num">${t.policy_step ?? "–"}</td><td class="num">${num(t.reward)}</td>
      <td>${Object.entries(t.rewards).map(([k, v]) => `<span class="badge">${esc(k)} ${num(v, 2)}</span>`).join(" ")}</td>
      <td class="num">${t.messages}</td><td class="num">${t.tokens}</td>
      <td>${t.complete ? "yes" : "no"}${t.token_exact ? "" : ' <span class="badge">not token-exact</span>'}</td>
      <td class="muted">${esc(t.last_message)}</td></tr>`,
    )
    .join("");
  return `<h2>Reward curve</h2>${curveSvg(curve)}
    <h2>Trajectories <span class="muted" id="total">${page.total}</span></h2>
    <form class="filters" id="filters">${field("task", "task")}${field("group", "group")}${field("split", "split")}
      ${field("policy_step", "policy step")}${field("reward_min", "reward ≥")}${field("reward_max", "reward ≤")}
      <button>Filter</button></form>
    <table id="trajectories"><thead><tr><th>id</th><th>task</th><th>group</th><th>step</th><th>reward</th><th>rewards</th>
      <th>msgs</th><th>tokens</th><th>complete</th><th>last message</th></tr></thead><tbody>${rows}</tbody></table>
    ${pageLinks(query, page.items.length, page.total)}`;
}

// One part of a content list as text: its `text` when a string, else the part (or its `text`) as JSON.
function partText(part) {
  if (typeof part === "string") return part;
  return typeof part?.text === "string" ? part.text : JSON.stringify(part?.text ?? part);
}

function messageHtml(message) {
  const role = message.role || "?";
  let content = message.content;
  if (Array.isArray(content)) {
    content = content.map(partText).join("\n");
  } else if (content !== null && typeof content === "object") content = JSON.stringify(content, null, 2);
  const calls = (message.tool_calls || [])
    .map((call) => {
      const fn = call.function || call;
      return `<pre class="tool-call">→ ${esc(fn.name)}(${esc(typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments))})</pre>`;
    })
    .join("");
  const tag = message.tool_call_id ? ` <span class="muted">${esc(message.tool_call_id)}</span>` : "";
  return `<div class="msg ${esc(role)}"><div class="role">${esc(role)}${tag}</div>${content ? `<pre>${esc(content)}</pre>` : ""}${calls}</div>`;
}

async function trajectoryView(id) {
  const t = await api(`/v1/view/trajectory?${new URLSearchParams({ id })}`); // a path loses an id `.` or `..`
  const rewards = Object.entries(t.rewards).map(([k, v]) => `<span class="badge">${esc(k)} ${num(v)}</span>`).join(" ") || "none";
  const sequences = t.sequences
    .map((s, i) => `<tr><td>${i}</td><td class="num">${s.prompt_tokens}</td><td class="num">${s.completion_tokens}</td><td class="num">${s.tokens}</td><td class="num">${s.policy_step ?? "–"}</td></tr>`)
    .join("");
  const judgements = t.judgements
    .map((j) => `<div class="judgement"><strong>${esc(j.name)} ${num(j.score)}</strong>${j.duplicate_of ? ` <span class="muted">(identical to ${esc(j.duplicate_of)}, judged once)</span>` : ""}<div>${esc(j.explanation)}</div></div>`)
    .join("");
  return `<h2>Trajectory <code>${esc(t.id)}</code></h2>
    <div class="kv"><span>trace</span><code>${esc(t.trace_id)}</code><span>group</span><span>${groupLink(t)}</span>
      <span>task / split</span><span>${esc(t.task)} / ${esc(t.split)}</span><span>model</span><span>${esc(t.model)}</span>
      <span>policy step</span><span>${t.policy_step ?? "–"}</span><span>training reward</span><span>${num(t.reward)}</span>
      <span>rewards</span><span id="rewards">${rewards}</span><span>tool calls</span><span>${t.tool_calls}</span>
      <span>complete</span><span>${t.complete ? "yes" : "no"}${t.token_exact ? "" : " (not token-exact)"}</span></div>
    <h3>Judge</h3>${judgements || '<p class="muted">Not judged.</p>'}
    <h3>Token sequences</h3><table><thead><tr><th>#</th><th>prompt</th><th>completion</th><th>total</th><th>step</th></tr></thead><tbody>${sequences}</tbody></table>
    <h3>Messages</h3><div id="messages">${t.conversation.map(messageHtml).join("")}</div>
    ${t.tools.length ? `<h3>Tools</h3><pre>${esc(JSON.stringify(t.tools, null, 2))}</pre>` : ""}
    ${Object.keys(t.metadata).length ? `<h3>Metadata</h3><pre>${esc(JSON.stringify(t.metadata, null, 2))}</pre>` : ""}`;
}

async function groupsView() {
  const groups = await api(`/v1/view/groups?limit=${PAGE_SIZE}`);
  const rows = groups
    .map((g) => {
      const j = g.judge;
      const judge = j ? `${esc(j.state)} (${j.distinct}/${j.trajectories} distinct)${j.error ? ` <span class="error">${esc(j.error)}</span>` : ""}` : "–";
      return `<tr><td><a href="#/?group=${encodeURIComponent(g.id)}">${esc(g.id)}</a></td><td>${esc(g.task)}</td><td class="num">${g.size}</td>
        <td class="num">${g.complete}</td><td class="num">${g.rewarded}</td><td>${esc(g.state)}</td><td class="muted">${esc(g.reason)}</td><td>${judge}</td></tr>`;
    })
    .join("");
  return `<h2>Groups <span class="muted">newest first, at most ${PAGE_SIZE}</span></h2><table id="groups"><thead><tr><th>id</th><th>task</th><th>size</th><th>complete</th><th>rewarded</th>
    <th>state</th><th>reason</th><th>judge</th></tr></thead><tbody>${rows}</tbody></table>`;
}

async function batchesView() {
  const batches = await api("/v1/view/batches");
  const rows = batches
    .map((b) => `<tr><td><code>${esc(b.id.slice(0, 12))}</code></td><td>${esc(b.trainer)}</td><td>${esc(b.state)}</td><td>${when(b.created_at)}</td>
      <td>${when(b.acked_at)}</td><td class="num">${b.policy_step ?? "–"}</td><td>${b.groups.map(esc).join(", ")}</td><td class="muted">${esc(b.reason)}</td></tr>`)
    .join("");
  return `<h2>Batches</h2><table id="batches"><thead><tr><th>id</th><th>trainer</th><th>state</th><th>leased</th><th>acked</th>
    <th>step</th><th>groups</th><th>reason</th></tr></thead><tbody>${rows}</tbody></table>`;
}

function at(seconds) {
  return `<time datetime="${new Date(seconds * 1000).toISOString()}">${when(seconds)}</time>`;
}

// The box atop every view: this collector's last Langfuse sync (GET /v1/langfuse/sync), when it ended and its counts,
// and the latest sync's failure as a warning (its text is Langfuse's answer); nothing when Langfuse is not configured.
async function langfuseBox() {
  let status;
  try {
    status = await api("/v1/langfuse/sync");
  } catch (error) {
    if (error.code === "langfuse_not_configured") return "";
    return `<aside id="langfuse" class="langfuse"><strong>Langfuse</strong> <span class="error">${esc(error.message)}</span></aside>`;
  }
  const last = status.last_sync;
  let done = '<span class="muted">no successful sync yet</span>';
  if (last?.skipped) done = `last sync ${at(status.last_sync_at)} <span class="muted">skipped: another replica was syncing</span>`;
  else if (last) {
    const counts = Object.entries(last).filter(([name]) => name !== "skipped");
    done = `last sync ${at(status.last_sync_at)} ${counts.map(([name, n]) => `<span class="badge">${esc(name)} ${esc(n)}</span>`).join(" ")}`;
  }
  const failed = status.last_error ? `<div class="warning">latest sync failed ${at(status.last_error_at)}: ${esc(status.last_error)}</div>` : "";
  return `<aside id="langfuse" class="langfuse"><strong>Langfuse</strong> ${done}${failed}</aside>`;
}

let routed = 0; // how many routes have started: a view whose reads finish after a later route's start is not drawn

async function route() {
  const ticket = ++routed;
  const langfuse = langfuseBox(); // read beside the view
  const hash = location.hash || "#/";
  const [path, search] = hash.slice(1).split("?");
  let html;
  try {
    if (path.startsWith("/t/")) html = await trajectoryView(decodeURIComponent(path.slice(3)));
    else if (path === "/groups") html = await groupsView();
    else if (path === "/batches") html = await batchesView();
    else html = await trajectoriesView(new URLSearchParams(search || ""));
  } catch (error) {
    html = `<p class="error">${esc(error.message)}</p>`;
  }
  html = (await langfuse) + html;
  if (ticket === routed) app.innerHTML = html;
}

app.addEventListener("submit", (event) => {
  if (event.target.id !== "filters") return;
  event.preventDefault();
  location.hash = `#/?${new URLSearchParams(new FormData(event.target))}`;
});
window.addEventListener("hashchange", route);
route();
