// Chat: a model or adapter from /v1/models, a system prompt and sampling settings, replies streamed from
// /v1/chat/completions (Markdown, reasoning folded, tool calls as such), Stop aborts the request, TTFT and
// tokens/s under each reply, the conversation exported as JSON.
import {ApiError, download, getJSON, streamSSE} from "/ui/api.js";
import {escapeHtml, renderMarkdown} from "/ui/markdown.js";

const $ = (id) => document.getElementById(id);

export function initChat() {
  const messages = [];  // {role, content, reasoning?, tool_calls?, stats?}
  let controller = null;
  let modelsLoaded = false;

  function showError(text) { $("chat-error").textContent = text; $("chat-error").hidden = !text; }

  async function loadModels() {
    try {
      const list = await getJSON("/v1/models");
      const select = $("chat-model");
      const keep = select.value;
      select.replaceChildren(...list.data.map((m) => {
        const o = document.createElement("option");
        o.value = m.id;
        o.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
        return o;
      }));
      if (list.data.some((m) => m.id === keep)) select.value = keep;
      modelsLoaded = true;
      showError("");
    } catch (e) {
      showError("Models: " + e.message + (e.status === 401 ? " (enter a key above)" : ""));
    }
  }

  function bubble(role) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.innerHTML = `<div class="role">${escapeHtml(role)}</div><div class="body"></div><div class="stats"></div>`;
    $("chat-log").appendChild(div);
    return div;
  }

  function renderAssistant(div, m) {
    let html = "";
    if (m.reasoning) {
      html += `<details class="reasoning"><summary>Reasoning (${m.reasoning.length} characters)</summary>` +
              `<pre>${escapeHtml(m.reasoning)}</pre></details>`;
    }
    html += renderMarkdown(m.content || "");
    for (const call of m.tool_calls || []) {
      html += `<div class="tool-call">tool call <code>${escapeHtml(call.function.name || "")}</code>` +
              `<pre><code>${escapeHtml(call.function.arguments || "")}</code></pre></div>`;
    }
    div.querySelector(".body").innerHTML = html;
    const s = m.stats;
    if (s) {
      const parts = [];
      if (s.ttft_ms != null) parts.push(`TTFT ${s.ttft_ms.toFixed(0)} ms`);
      if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tokens/s`);
      if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
      if (s.finish_reason) parts.push(s.finish_reason);
      div.querySelector(".stats").textContent = parts.join(" · ");
    }
  }

  function settings() {
    const body = {model: $("chat-model").value, temperature: parseFloat($("chat-temperature").value),
                  top_p: parseFloat($("chat-top-p").value), max_tokens: parseInt($("chat-max-tokens").value, 10)};
    const seed = $("chat-seed").value;
    if (seed !== "") body.seed = parseInt(seed, 10);
    const extra = $("chat-extra").value.trim();  // the server's other fields (stop, min_tokens, tools, ...)
    return extra ? Object.assign(body, JSON.parse(extra)) : body;
  }

  async function send(text) {
    showError("");
    let fields;
    try { fields = settings(); } catch (e) { showError("More request fields: " + e.message); return; }
    const user = {role: "user", content: text};
    messages.push(user);
    bubble("user").querySelector(".body").innerHTML = renderMarkdown(text);
    const reply = {role: "assistant", content: "", reasoning: "", tool_calls: [], stats: {}};
    messages.push(reply);
    const div = bubble("assistant");
    const system = $("chat-system").value.trim();
    const history = messages.filter((m) => m !== reply).map((m) => {
      const out = {role: m.role, content: m.content};
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      return out;
    });
    const body = Object.assign(fields, {stream: true, stream_options: {include_usage: true},
      messages: (system ? [{role: "system", content: system}] : []).concat(history)});
    controller = new AbortController();
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    const sent = performance.now();
    let first = null;
    try {
      await streamSSE("/v1/chat/completions", body, (event) => {
        if (event.usage) reply.stats.completion_tokens = event.usage.completion_tokens;
        for (const choice of event.choices || []) {
          const d = choice.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) first = first ?? performance.now();
          if (d.content) reply.content += d.content;
          if (d.reasoning_content) reply.reasoning += d.reasoning_content;
          for (const tc of d.tool_calls || []) {
            const slot = reply.tool_calls[tc.index] ??= {id: tc.id, type: "function", function: {name: "", arguments: ""}};
            if (tc.id) slot.id = tc.id;
            if (tc.function && tc.function.name) slot.function.name += tc.function.name;
            if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
          }
          if (choice.finish_reason) reply.stats.finish_reason = choice.finish_reason;
        }
        renderAssistant(div, reply);
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }, controller.signal);
    } catch (e) {
      if (e.name === "AbortError") reply.stats.finish_reason = "stopped";
      else showError(e instanceof ApiError ? `${e.status}: ${e.message}` : String(e));
    } finally {
      const end = performance.now();
      if (first != null) {
        reply.stats.ttft_ms = first - sent;
        const n = reply.stats.completion_tokens;
        if (n != null && end > first) reply.stats.tokens_per_s = n / ((end - first) / 1000);
      }
      renderAssistant(div, reply);
      controller = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
      div.dataset.done = "1";
    }
  }

  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("chat-input").value;
    if (!text.trim() || controller) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("chat-clear").addEventListener("click", () => { messages.length = 0; $("chat-log").replaceChildren(); });
  $("chat-export").addEventListener("click", () => {
    const doc = {model: $("chat-model").value, system: $("chat-system").value, settings: settings(),
                 exported_at: new Date().toISOString(), messages};
    download($("chat-download"), "tokenmill-chat.json", JSON.stringify(doc, null, 2), "application/json");
  });

  return {
    enter() { if (!modelsLoaded) loadModels(); },
    keyChanged() { modelsLoaded = false; },
  };
}
