// The session page of Parrot's manager: polls /v1/sessions/{id}/graph and draws the DAG.
// The session token comes from the URL's fragment (#token=...), which browsers never
// send to a server; it is presented as the Authorization header of the page's requests.
// Every value is put in the page as text (textContent), never parsed as HTML.
"use strict";

(function () {
  const POLL_MS = 500;
  const VALUE_CHARS = 2000;
  const SVG = "http://www.w3.org/2000/svg";
  const COL_W = 190, ROW_H = 64, NODE_W = 150, NODE_H = 40, PAD = 16;

  const parts = location.pathname.split("/");
  const sessionId = decodeURIComponent(parts[parts.length - 1] || "");
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  const graphUrl = "../../v1/sessions/" + encodeURIComponent(sessionId) + "/graph?value_chars=" + VALUE_CHARS;
  let lastBody = null;
  let polls = 0;

  function el(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setStatus(state, text) {
    const status = document.getElementById("status");
    status.dataset.state = state;
    status.textContent = text;
  }

  // Depth of each node: a variable without a producer is 0; a call is one past its
  // deepest input; an output one past its call.
  function layout(graph) {
    const depth = new Map();
    const calls = new Map(graph.calls.map((c) => [c.call_id, c]));
    const vars = new Map(graph.variables.map((v) => [v.var_id, v]));
    function callDepth(id, seen) {
      if (depth.has(id)) return depth.get(id);
      if (seen.has(id)) return 0;
      seen.add(id);
      let d = 0;
      for (const vid of Object.values(calls.get(id).inputs)) {
        if (vars.has(vid)) d = Math.max(d, varDepth(vid, seen) + 1);
      }
      depth.set(id, d);
      return d;
    }
    function varDepth(id, seen) {
      if (depth.has(id)) return depth.get(id);
      const v = vars.get(id);
      const d = v.producer && calls.has(v.producer) ? callDepth(v.producer, seen) + 1 : 0;
      depth.set(id, d);
      return d;
    }
    for (const id of calls.keys()) callDepth(id, new Set());
    for (const id of vars.keys()) varDepth(id, new Set());
    const rows = new Map();
    const pos = new Map();
    for (const [id, d] of depth) {
      const row = rows.get(d) || 0;
      rows.set(d, row + 1);
      pos.set(id, { x: PAD + d * COL_W, y: PAD + row * ROW_H });
    }
    const width = PAD * 2 + (Math.max(0, ...rows.keys()) + 1) * COL_W;
    const height = PAD * 2 + Math.max(1, ...rows.values()) * ROW_H;
    return { pos, width, height };
  }

  function label(text, max) {
    return text.length > max ? text.slice(0, max - 1) + "…" : text;
  }

  function drawGraph(graph) {
    const svg = document.getElementById("dag");
    const { pos, width, height } = layout(graph);
    svg.replaceChildren();
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const defs = el("defs");
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    marker.appendChild(el("path", { d: "M 0 0 L 10 5 L 0 10 z" }));
    defs.appendChild(marker);
    svg.appendChild(defs);
    const edges = el("g", { class: "edges" });
    const nodes = el("g", { class: "nodes" });
    svg.append(edges, nodes);
    function edge(from, to) {
      const a = pos.get(from), b = pos.get(to);
      if (!a || !b) return;
      const x1 = a.x + NODE_W, y1 = a.y + NODE_H / 2, x2 = b.x, y2 = b.y + NODE_H / 2;
      const mid = (x1 + x2) / 2;
      edges.appendChild(el("path", { class: "edge", "data-from": from, "data-to": to,
        d: `M ${x1} ${y1} C ${mid} ${y1}, ${mid} ${y2}, ${x2} ${y2}`, "marker-end": "url(#arrow)" }));
    }
    for (const c of graph.calls) {
      for (const vid of new Set(Object.values(c.inputs))) edge(vid, c.call_id);
      for (const vid of Object.values(c.outputs)) edge(c.call_id, vid);
    }
    for (const c of graph.calls) {
      const sub = [c.state, c.objective, c.engine_id].filter(Boolean).join(" · ");
      nodes.appendChild(node("call", c.call_id, c.state, pos.get(c.call_id), {
        rx: 3, x: 8, title: label(c.name || c.call_id, 20), sub: label(sub, 24), subClass: "sub",
        tooltip: `${c.call_id}: ${c.placement || c.state}` }));
    }
    for (const v of graph.variables) {
      nodes.appendChild(node("var", v.var_id, v.state, pos.get(v.var_id), {
        rx: 18, x: 12, title: label(v.name || v.var_id, 20), sub: label(v.text || v.state, 22),
        subClass: "sub value", tooltip: v.text || v.var_id }));
    }
  }

  // One node of the DAG at `p`: class "node <kind> <state>", data-id and data-state, a
  // box with corner radius `look.rx`, a title line and a sub line indented by `look.x`,
  // and a tooltip.
  function node(kind, id, state, p, look) {
    const g = el("g", { class: `node ${kind} ${state}`, "data-id": id, "data-state": state,
      transform: `translate(${p.x},${p.y})` });
    g.appendChild(el("rect", { width: NODE_W, height: NODE_H, rx: look.rx }));
    g.appendChild(el("text", { x: look.x, y: 16 }, look.title));
    g.appendChild(el("text", { x: look.x, y: 32, class: look.subClass }, look.sub));
    g.appendChild(el("title", {}, look.tooltip));
    return g;
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  function seconds(from, to) {
    return from && to ? (to - from).toFixed(2) + " s" : "";
  }

  // The rows of one table's body, one an item: data-id and data-state on the row, the
  // item's name (with its id) and state, then the cells `more(row, item)` adds.
  function fillTable(selector, items, idKey, more) {
    const body = document.querySelector(selector);
    body.replaceChildren();
    for (const item of items) {
      const id = item[idKey];
      const tr = document.createElement("tr");
      tr.dataset.id = id;
      tr.dataset.state = item.state;
      cell(tr, item.name ? `${item.name} (${id})` : id);
      cell(tr, item.state, "state " + item.state);
      more(tr, item);
      body.appendChild(tr);
    }
  }

  function drawTables(graph) {
    fillTable("#calls tbody", graph.calls, "call_id", (tr, c) => {
      cell(tr, c.objective);
      cell(tr, c.task_group);
      cell(tr, c.engine_id);
      cell(tr, c.placement);
      cell(tr, c.prompt_tokens);
      cell(tr, c.prefix_reused_tokens, "prefix-reused");
      cell(tr, c.filled_tokens, "filled");
      cell(tr, c.generated_tokens);
      cell(tr, seconds(c.submitted_at, c.started_at));
      cell(tr, seconds(c.started_at, c.first_token_at));
      cell(tr, seconds(c.submitted_at, c.finished_at));
      cell(tr, c.error ? `${c.error.code}: ${c.error.message}` : "");
    });
    fillTable("#variables tbody", graph.variables, "var_id", (tr, v) => {
      cell(tr, v.producer);
      const text = v.error ? `${v.error.code}: ${v.error.message}` : (v.text || "") + (v.text_truncated ? " …" : "");
      cell(tr, text, "value");
    });
  }

  async function poll() {
    let response;
    try {
      response = await fetch(graphUrl, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    } catch (err) {
      setStatus("offline", "cannot reach the manager; retrying");
      setTimeout(poll, POLL_MS * 4);
      return;
    }
    if (!response.ok) {
      let message = `HTTP ${response.status}`;
      try {
        const body = await response.json();
        if (body && body.error) message += `: ${body.error.message}`;
      } catch (err) { /* not JSON: the status says enough */ }
      setStatus("error", message);
      return; // a wrong token or a closed session does not come right by asking again
    }
    const body = await response.text();
    polls += 1;
    document.body.dataset.polls = String(polls);
    if (body !== lastBody) {
      lastBody = body;
      const graph = JSON.parse(body);
      drawGraph(graph);
      drawTables(graph);
      const busy = graph.calls.filter((c) => !["done", "failed"].includes(c.state)).length;
      setStatus("live", `${graph.calls.length} calls, ${busy} not finished · live`);
    }
    setTimeout(poll, POLL_MS);
  }

  function start() {
    document.getElementById("session-id").textContent = sessionId;
    if (!token) {
      setStatus("error", "no session token in this URL: open the link from session.ui_url (…#token=…)");
      return;
    }
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
