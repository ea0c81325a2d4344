// deepinfer's built-in page: the chat playground (streams /v1/chat/completions over SSE) and the
// live dashboard (polls /ui/stats.json). Plain JS, no dependencies: the page must work offline.
// window.deepinferUI exposes counters the browser test reads (SSE chunks seen, polls done).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "deepinfer.apiKey";
  const POLL_MS = 1000;
  const SPARK_POINTS = 60;
  const ui = (window.deepinferUI = { chunks: 0, polls: 0, stats: null, busy: false });

  // ---- API key and requests -------------------------------------------------------------

  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem(KEY_STORE) || "";
  keyInput.addEventListener("input", () => localStorage.setItem(KEY_STORE, keyInput.value.trim()));

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = keyInput.value.trim();
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  function needKey() {
    // the server answered 401: show the field even if the page did not know a key was needed
    document.body.dataset.auth = "on";
    keyInput.focus();
  }

  async function errorMessage(resp) {
    if (resp.status === 401) needKey();
    try {
      const body = await resp.json();
      return `${resp.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
    } catch (_) {
      return `${resp.status} ${resp.statusText}`;
    }
  }

  // ---- tabs -----------------------------------------------------------------------------

  for (const tab of document.querySelectorAll(".tabs button")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }

  function showView(name) {
    for (const tab of document.querySelectorAll(".tabs button")) {
      tab.setAttribute("aria-selected", String(tab.dataset.view === name));
    }
    $("view-chat").hidden = name !== "chat";
    $("view-dash").hidden = name !== "dash";
    if (name === "dash") drawSpark();
  }

  // ---- playground -----------------------------------------------------------------------

  const history = []; // {role, content}: what the next request sends (reasoning is not sent back)
  let controller = null;

  const EXAMPLE_SCHEMA = {
    type: "object",
    properties: { city: { type: "string" }, country: { type: "string" } },
    required: ["city", "country"],
  };
  $("schema-example").addEventListener("click", () => {
    $("schema").value = JSON.stringify(EXAMPLE_SCHEMA, null, 2);
    checkSchema();
  });
  $("schema").addEventListener("input", checkSchema);

  function checkSchema() {
    const err = $("schema-error");
    try {
      schema();
      err.hidden = true;
      return true;
    } catch (e) {
      err.textContent = e.message;
      err.hidden = false;
      return false;
    }
  }

  function schema() {
    const text = $("schema").value.trim();
    if (!text) return null;
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new Error(`the schema is not JSON: ${e.message}`);
    }
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      throw new Error("the schema must be a JSON object");
    }
    return value;
  }

  function number(id, parse) {
    const text = $(id).value.trim();
    if (text === "") return undefined;
    const v = parse(text);
    if (Number.isNaN(v)) throw new Error(`${id}: not a number`);
    return v;
  }

  function requestBody() {
    const body = { messages: [], stream: true, stream_options: { include_usage: true } };
    const system = $("system").value.trim();
    if (system) body.messages.push({ role: "system", content: system });
    body.messages.push(...history);
    const knobs = {
      temperature: number("temperature", parseFloat),
      top_p: number("top_p", parseFloat),
      top_k: number("top_k", (t) => parseInt(t, 10)),
      max_tokens: number("max_tokens", (t) => parseInt(t, 10)),
      seed: number("seed", (t) => parseInt(t, 10)),
    };
    for (const [k, v] of Object.entries(knobs)) if (v !== undefined) body[k] = v;
    const s = schema();
    if (s) body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: s } };
    if ($("thinking").checked) {
      body.chat_template_kwargs = { thinking: true };
      const budget = number("thinking_budget", (t) => parseInt(t, 10));
      if (budget !== undefined) body.thinking_token_budget = budget;
    }
    return body;
  }

  function addMessage(role, text) {
    $("empty").hidden = true;
    const msg = document.createElement("div");
    msg.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "You" : ui.stats ? ui.stats.model : "assistant";
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    const answer = document.createElement("div");
    answer.className = "answer";
    answer.textContent = text;
    bubble.append(answer);
    const meta = document.createElement("div");
    meta.className = "meta";
    msg.append(who, bubble, meta);
    $("messages").append(msg);
    scrollDown();
    return { msg, bubble, answer, meta, reasoning: null };
  }

  function reasoningBlock(view) {
    // created on the first reasoning_content delta: open while the model thinks
    if (view.reasoning) return view.reasoning;
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Thinking…";
    const thought = document.createElement("div");
    thought.className = "thought";
    details.append(summary, thought);
    view.bubble.prepend(details);
    view.reasoning = { details, summary, thought };
    return view.reasoning;
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  // SSE events of a fetch response: the data of each event (a JSON text or "[DONE]")
  async function* sseData(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.search(/\r?\n\r?\n/)) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end).replace(/^\r?\n\r?\n/, "");
        const data = block
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  function setBusy(busy) {
    ui.busy = busy;
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("clear").disabled = busy;
  }

  async function send() {
    const text = $("prompt").value.trim();
    if (!text || ui.busy) return;
    let body;
    history.push({ role: "user", content: text });
    try {
      body = requestBody();
    } catch (e) {
      history.pop();
      $("schema-error").textContent = e.message; // a bad knob or schema: shown in the settings pane
      $("schema-error").hidden = false;
      return;
    }
    $("prompt").value = "";
    addMessage("user", text);
    const view = addMessage("assistant", "");
    view.msg.classList.add("streaming");
    setBusy(true);
    controller = new AbortController();
    const t0 = performance.now();
    let tFirst = null;
    let answer = "";
    let finish = null;
    let usage = null;
    let failed = null;
    let thinkingEnded = false;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorMessage(resp));
      for await (const data of sseData(resp)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
        ui.chunks += 1;
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = choice.delta || {};
          if (delta.reasoning_content) {
            tFirst = tFirst ?? performance.now();
            reasoningBlock(view).thought.textContent += delta.reasoning_content;
          }
          if (delta.content) {
            tFirst = tFirst ?? performance.now();
            if (view.reasoning && !thinkingEnded) {
              // the answer begins: fold the reasoning away (a click opens it again)
              thinkingEnded = true;
              view.reasoning.details.open = false;
              view.reasoning.summary.textContent = `Thought for ${((performance.now() - t0) / 1000).toFixed(1)} s`;
            }
            answer += delta.content;
            view.answer.textContent = answer;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        scrollDown();
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else failed = e.message;
    } finally {
      controller = null;
      view.msg.classList.remove("streaming");
      setBusy(false);
    }
    if (view.reasoning && !thinkingEnded) view.reasoning.summary.textContent = "Thoughts";
    if (failed !== null) {
      if (!answer) history.pop(); // nothing came back: the message can be sent again
      view.meta.classList.add("error");
      view.meta.textContent = failed;
      if (!answer && !view.reasoning) view.answer.textContent = "(no answer)";
    } else {
      history.push({ role: "assistant", content: answer });
      view.meta.textContent = describe(t0, tFirst, performance.now(), usage, finish);
    }
    scrollDown();
    $("prompt").focus();
  }

  function describe(t0, tFirst, tEnd, usage, finish) {
    const parts = [];
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (tFirst !== null) parts.push(`${((tFirst - t0) / 1000).toFixed(2)} s to first token`);
    if (usage && tFirst !== null && usage.completion_tokens > 1 && tEnd > tFirst) {
      parts.push(`${((usage.completion_tokens - 1) / ((tEnd - tFirst) / 1000)).toFixed(1)} tok/s`);
    }
    if (finish) parts.push(`finish: ${finish}`);
    return parts.join(" · ");
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    history.length = 0;
    for (const m of document.querySelectorAll("#messages .msg")) m.remove();
    $("empty").hidden = false;
  });

  // ---- dashboard ------------------------------------------------------------------------

  const spark = [];
  const fmtInt = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
  const fmtRate = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
  const fmtMs = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(2));
  const fmtPct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)}%`);

  function set(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
  }

  function render(s) {
    set("model-name", s.model);
    const dot = $("status-dot");
    dot.className = `dot ${s.engine_alive && !s.draining ? "ok" : "bad"}`;
    dot.title = s.draining ? "shutting down" : s.engine_alive ? "engine running" : "engine loop stopped";
    const r = s.requests;
    set("live-running", String(r.running));
    set("live-waiting", String(r.waiting));
    set("live-tps", fmtRate(s.tokens.generated_per_s));
    set("s-running", fmtInt(r.running));
    set("s-waiting", fmtInt(r.waiting));
    set("s-inflight", fmtInt(r.in_flight));
    set("s-finished", fmtInt(r.finished));
    set("s-preempt", fmtInt(r.preemptions));
    set("s-slots", `${fmtInt(s.kv.slots_used)} / ${fmtInt(s.max_num_seqs)}`);

    const t = s.tokens;
    set("s-tps", fmtRate(t.generated_per_s));
    set("s-pps", fmtRate(t.prompt_per_s));
    set("s-generated", fmtInt(t.generated));
    set("s-prompt", fmtInt(t.prompt));
    spark.push(t.generated_per_s || 0);
    if (spark.length > SPARK_POINTS) spark.shift();
    if (!$("view-dash").hidden) drawSpark();

    const st = s.steps;
    set("s-steps-ps", fmtRate(st.per_s));
    set("s-steps", fmtInt(st.total));
    set("s-host", fmtMs(st.host_ms_mean));
    set("s-wait", fmtMs(st.wait_ms_mean));
    set("s-device", fmtMs(st.device_ms_mean));
    set("s-busy", fmtPct(st.device_busy_fraction));
    $("busy-fill").style.width = `${100 * (st.device_busy_fraction || 0)}%`;

    set("kv-usage", `${fmtPct(s.kv.usage)} of all pages held by requests`);
    renderPools(s.kv.pools);

    const sd = s.spec_decode;
    set("s-accept", fmtPct(sd.acceptance_rate));
    set("s-drafts", fmtInt(sd.num_drafts));
    set("s-draft-tokens", fmtInt(sd.num_draft_tokens));
    set("s-accepted", fmtInt(sd.num_accepted_tokens));
    renderPositions(sd);

    const pc = s.prefix_cache;
    set("s-hit-rate", fmtPct(pc.hit_rate));
    set("s-hits", fmtInt(pc.hits));
    set("s-queries", fmtInt(pc.queries));
    set("s-blocks", fmtInt(pc.blocks));
  }

  function renderPools(pools) {
    const box = $("pools");
    const names = Object.keys(pools);
    if (box.childElementCount !== names.length) {
      box.replaceChildren(...names.map((name) => {
        const row = document.createElement("div");
        row.className = "pool";
        row.innerHTML = '<span class="name"></span><div class="bar"><div class="used"></div><div class="cached"></div></div>'
          + '<span class="nums"></span>';
        row.querySelector(".name").textContent = name;
        return row;
      }));
    }
    names.forEach((name, i) => {
      const p = pools[name];
      const row = box.children[i];
      const total = p.total || 1;
      row.querySelector(".used").style.width = `${(100 * p.used) / total}%`;
      row.querySelector(".cached").style.width = `${(100 * p.cached) / total}%`;
      row.querySelector(".nums").textContent =
        `${fmtInt(p.used)} used · ${fmtInt(p.cached)} cached · ${fmtInt(p.free)} free / ${fmtInt(p.total)}`;
    });
  }

  function renderPositions(sd) {
    const box = $("positions");
    const per = sd.accepted_per_position || [];
    if (!per.length) {
      box.innerHTML = '<p class="hint">Off on this server (--speculative-config turns it on).</p>';
      return;
    }
    if (box.childElementCount !== per.length) {
      box.replaceChildren(...per.map((_, i) => {
        const row = document.createElement("div");
        row.className = "pos";
        row.innerHTML = `<span>draft ${i + 1}</span><div class="meter"><div class="fill"></div></div><span></span>`;
        return row;
      }));
    }
    per.forEach((n, i) => {
      const rate = sd.num_drafts ? n / sd.num_drafts : 0;
      const row = box.children[i];
      row.querySelector(".fill").style.width = `${100 * rate}%`;
      row.lastElementChild.textContent = sd.num_drafts ? fmtPct(rate) : "–";
    });
  }

  function drawSpark() {
    const w = 600;
    const h = 120;
    const top = Math.max(1, ...spark) * 1.15;
    const step = w / (SPARK_POINTS - 1);
    const x0 = w - step * (spark.length - 1);
    const pts = spark.map((v, i) => `${(x0 + i * step).toFixed(1)},${(h - (h * v) / top).toFixed(1)}`);
    $("spark-line").setAttribute("d", pts.length ? `M${pts.join("L")}` : "");
    $("spark-area").setAttribute("d", pts.length ? `M${x0},${h}L${pts.join("L")}L${w},${h}Z` : "");
  }

  async function poll() {
    try {
      const resp = await fetch("/ui/stats.json", { headers: headers(), cache: "no-store" });
      if (resp.ok) {
        ui.stats = await resp.json();
        ui.polls += 1;
        render(ui.stats);
        set("dash-note", "Polls /ui/stats.json every second.");
      } else {
        set("dash-note", `stats: ${await errorMessage(resp)}`);
        $("status-dot").className = "dot bad";
      }
    } catch (e) {
      set("dash-note", `stats: the server does not answer (${e.message})`);
      $("status-dot").className = "dot bad";
    }
    setTimeout(poll, document.hidden ? 5 * POLL_MS : POLL_MS);
  }

  poll();
  $("prompt").focus();
})();
