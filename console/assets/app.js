// The infermesh console: renders the state the agent streams (/api/stream,
// server-sent events) into the map, the tables of roles, recent requests and
// events. Text goes into the page only through textContent: nothing the
// agent reports is read as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function rows(tbody, list, row) {
  tbody.replaceChildren(...list.map(row));
}

function ago(iso) {
  if (!iso) return "-";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 1) return "now";
  if (s < 60) return Math.round(s) + "s ago";
  if (s < 3600) return Math.round(s / 60) + "m ago";
  return Math.round(s / 3600) + "h ago";
}

function until(iso) {
  if (!iso) return "-";
  const s = (Date.parse(iso) - Date.now()) / 1000;
  if (s <= 0) return "EXPIRED";
  if (s < 3600) return "in " + Math.round(s / 60) + "m";
  if (s < 172800) return "in " + Math.round(s / 3600) + "h";
  return "in " + Math.round(s / 86400) + "d";
}

// capText is an instance's capacity: ", 2/4 slots, 1 queued, kv 42%,
// cache hit 73%".
function capText(c) {
  if (!c) return "";
  let s = c.slots > 0 ? `, ${c.running}/${c.slots} slots` : `, ${c.running} running`;
  if (c.waiting > 0) s += `, ${c.waiting} queued`;
  if (c.kv_usage > 0) s += `, kv ${Math.round(c.kv_usage * 100)}%`;
  if (c.cache_hit_ratio !== undefined) s += `, cache hit ${Math.round(c.cache_hit_ratio * 100)}%`;
  return s;
}

// routeText is how a request's candidate was chosen: the reason, and the
// chosen candidate's estimated time to first token and expected cached
// prefix; title lists every candidate's estimate.
function routeText(r) {
  const d = r.route;
  if (!d) return { text: "-", title: "one candidate: nothing to decide" };
  const est = (c) => c.estimated ? `${c.estimate_ms.toFixed(0)} ms` : "not estimated";
  const c = (d.candidates || []).find((x) => x.target === r.target);
  let text = d.reason;
  if (c && c.estimated) text += ` (${est(c)}${c.cached_tokens ? `, ${c.cached_tokens} cached` : ""})`;
  if (d.queued_ms) text += `, queued ${d.queued_ms.toFixed(0)} ms`;
  const title = `${d.policy}, key ${d.key}: ` + (d.candidates || []).map((x) =>
    `${x.target} ${est(x)}${x.affine ? " (affine)" : ""}${x.full ? " (full)" : ""}`).join("; ");
  return { text, title };
}

function clock(iso) {
  return new Date(iso).toLocaleTimeString();
}

// drawMap places the nodes on a circle and draws, for every role a node
// uses, an arrow to each node serving it to that node (the first solid,
// the others, its failovers, dashed).
function drawMap(view) {
  const s = document.getElementById("map-svg");
  const W = 640, H = 420, R = 34;
  const nodes = view.nodes.filter((n) => n.state !== "refused");
  const pos = {};
  const cx = W / 2, cy = H / 2, rad = nodes.length > 1 ? Math.min(W, H) / 2 - 60 : 0;
  nodes.forEach((n, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / nodes.length;
    pos[n.name] = { x: cx + rad * Math.cos(a), y: cy + rad * Math.sin(a) };
  });
  const load = {};
  for (const n of view.nodes) {
    for (const r of n.roles || []) {
      const c = r.capacity;
      load[n.name + "/" + r.name] = (r.in_flight ?? r.load) + (c && c.slots > 0 ? "/" + c.slots : "") + (c && c.waiting > 0 ? " +" + c.waiting + " queued" : "");
    }
  }

  const defs = svg("defs");
  const marker = svg("marker", { id: "head", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M0,0 L10,5 L0,10 z" }));
  defs.append(marker);
  const arrows = svg("g", { class: "arrows" });
  const pairs = {};
  for (const n of nodes) {
    for (const u of n.uses || []) {
      u.nodes.forEach((to, rank) => {
        if (to === n.name || !pos[to]) return; // its own instance: no arrow
        const key = n.name + ">" + to;
        const k = (pairs[key] = (pairs[key] || 0) + 1);
        const a = pos[n.name], b = pos[to];
        const dx = b.x - a.x, dy = b.y - a.y, len = Math.hypot(dx, dy) || 1;
        const ux = dx / len, uy = dy / len;
        // Offset sideways so a->b and b->a, and several roles, do not overlap.
        const off = 8 * k;
        const sx = a.x + ux * R - uy * off, sy = a.y + uy * R + ux * off;
        const ex = b.x - ux * (R + 2) - uy * off, ey = b.y - uy * (R + 2) + ux * off;
        arrows.append(svg("path", {
          class: "arrow" + (rank > 0 ? " standby" : ""), d: `M${sx},${sy} L${ex},${ey}`,
          "data-from": n.name, "data-to": to, "data-role": u.role,
        }));
        const l = load[to + "/" + u.role];
        arrows.append(svg("text", { class: "arrow-label", x: (sx + ex) / 2 - uy * 10, y: (sy + ey) / 2 + ux * 10 },
          u.role + (l !== undefined ? " · " + l : "")));
      });
    }
  }
  const g = svg("g", { class: "nodes" });
  for (const n of nodes) {
    const p = pos[n.name];
    const ng = svg("g", { class: "node " + n.state + (n.state === "self" ? " self" : ""), "data-node": n.name, transform: `translate(${p.x},${p.y})` });
    if (n.state === "self") ng.append(svg("circle", { class: "outer", r: R + 5 }));
    ng.append(svg("circle", { r: R }));
    ng.append(svg("text", { y: -6 }, n.name));
    const local = (n.roles || []).map((r) => r.name).join(", ");
    ng.append(svg("text", { class: "sub", y: 10 }, local || n.state));
    g.append(ng);
  }
  s.replaceChildren(defs, arrows, g);
}

function render(st) {
  const status = st.status, view = st.mesh;
  document.getElementById("node").textContent =
    `node ${status.node} · ${status.version} · mesh ${status.mesh.state}` +
    (status.mesh.state === "joined" ? ` (${status.mesh.members} members)` : "");
  drawMap(view);
  rows(document.querySelector("#nodes tbody"), view.nodes, (n) => el("tr", { "data-node": n.name },
    el("td", {}, n.name + (n.state === "self" ? " (this node)" : "")),
    el("td", {}, n.state + (n.why ? ": " + n.why : "")),
    el("td", {}, n.scope || "-"),
    el("td", {}, n.version || (n.info_error ? "no info" : "-")),
    el("td", { class: "num" }, n.rtt_ms ? n.rtt_ms.toFixed(2) + " ms" : "-"),
    el("td", {}, ago(n.last_heard)),
    el("td", {}, until(n.cert_expires)),
    el("td", {}, (n.roles || []).map((r) =>
      `${r.name} (${r.serves_us ? (n.state === "self" ? "local" : "serves us") : "not: " + (r.why || []).join(",")}, load ${r.in_flight ?? r.load}${capText(r.capacity)})`).join("; ") || "-"),
  ));
  rows(document.querySelector("#roles tbody"), st.routes, (rt) => {
    const cands = rt.decisions.filter((d) => d.candidate).sort((a, b) => a.rank - b.rank);
    const rest = rt.decisions.filter((d) => !d.candidate);
    return el("tr", { "data-role": rt.role },
      el("td", {}, rt.role),
      el("td", {}, rt.serving || "nobody"),
      el("td", {}, cands.map((d) => `${d.node} (${d.kind}, load ${d.load}${capText(d.capacity)}${d.notes ? ", " + d.notes.join(", ") : ""})`).join(" → ") || "-"),
      el("td", { class: "num queue" }, String(rt.queue || 0)),
      el("td", { class: "num cache-hit", title: "the local instance's prefix cache hit ratio over recent minutes, from its metrics" },
        rt.cache_hit_ratio === undefined ? "-" : Math.round(rt.cache_hit_ratio * 100) + "%"),
      el("td", {}, rest.map((d) => `${d.node}: ${(d.reasons || []).join(", ")}`).join("; ") || "-"),
    );
  });
  rows(document.querySelector("#requests tbody"), st.recent, (r) => el("tr", { "data-id": r.id, class: r.status >= 400 ? "error" : "" },
    el("td", {}, clock(r.time)),
    el("td", {}, r.id),
    el("td", {}, r.role),
    el("td", {}, r.source),
    el("td", {}, r.target || "none"),
    (() => { const rt = routeText(r); return el("td", { class: "route", title: rt.title }, rt.text); })(),
    el("td", { class: "num" }, r.status + (r.aborted ? " (cut)" : "")),
    el("td", { class: "num" }, r.duration_ms.toFixed(1) + " ms"),
    el("td", { class: "num" }, r.ttft_ms ? r.ttft_ms.toFixed(1) + " ms" : "-"),
    el("td", { class: "num" }, r.attempts),
    el("td", { class: "num" }, r.completion_tokens ? `${r.prompt_tokens || 0} + ${r.completion_tokens}` : "-"),
  ));
  rows(document.querySelector("#events tbody"), st.events.slice().reverse(), (e) => el("tr", {},
    el("td", {}, clock(e.time)),
    el("td", {}, e.kind),
    el("td", {}, e.role || "-"),
    el("td", {}, e.node || "-"),
    el("td", {}, Object.entries(e.fields || {}).map(([k, v]) => `${k}=${v}`).join(" ")),
  ));
}

function connect() {
  const live = document.getElementById("live");
  const es = new EventSource("/api/stream");
  es.addEventListener("open", () => { live.className = "on"; });
  es.addEventListener("error", () => { live.className = "off"; });
  es.addEventListener("state", (ev) => {
    live.className = "on";
    render(JSON.parse(ev.data));
  });
}

connect();
