// Usage: /v1/usage over a chosen range (the admin key: every tenant; a tenant's key: its own rows, as the server
// answers — the page asks for nothing more), CSV download, and /admin/tenants (the admin key): each tenant's
// limits, what it holds now and which limits it is at (being throttled).
import {download, getJSON, request} from "/ui/api.js";
import {escapeHtml} from "/ui/markdown.js";

const $ = (id) => document.getElementById(id);
const NUMERIC = new Set(["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "cost"]);

function day(offset) {
  const d = new Date(Date.now() + offset * 86400e3);
  return d.toISOString().slice(0, 10);
}

function table(el, rows, columns, cell) {
  if (!rows.length) { el.innerHTML = "<tr><td>no rows</td></tr>"; return; }
  const head = "<tr>" + columns.map((c) => `<th>${escapeHtml(c)}</th>`).join("") + "</tr>";
  el.innerHTML = head + rows.map((r) => "<tr>" + columns.map((c) => cell(r, c)).join("") + "</tr>").join("");
}

export function initUsage() {
  let loaded = false;
  $("usage-from").value = day(-6);
  $("usage-to").value = day(0);

  function query(format) {
    const q = new URLSearchParams({from: $("usage-from").value, to: $("usage-to").value,
                                   group_by: $("usage-group").value, format});
    return "/v1/usage?" + q.toString();
  }
  function showError(text) { $("usage-error").textContent = text; $("usage-error").hidden = !text; }

  async function load() {
    showError("");
    try {
      const body = await getJSON(query("json"));
      const rows = body.data;
      const columns = rows.length ? Object.keys(rows[0]) : ["tenant", "model", "requests"];
      table($("usage-table"), rows, columns, (r, c) => {
        const v = r[c];
        if (c === "cost" && typeof v === "number") return `<td class="num">${v.toFixed(6)}</td>`;
        return NUMERIC.has(c) ? `<td class="num">${escapeHtml(String(v))}</td>` : `<td>${escapeHtml(String(v))}</td>`;
      });
      $("usage-table").dataset.loaded = "1";
    } catch (e) {
      showError(`Usage: ${e.status || ""} ${e.message}`);
    }
    await limits();
  }

  async function limits() {
    const note = (t) => { $("limits-note").textContent = t; $("limits-note").hidden = !t; };
    try {
      const body = await getJSON("/admin/tenants");
      note("");
      const lim = (r) => Object.entries(r.limits).filter(([, v]) => v != null).map(([k, v]) => `${k} ${v}`)
        .join(", ") || "none";
      table($("limits-table"), body.data, ["tenant", "limits", "in flight", "left this minute", "today", "at limit"],
        (r, c) => {
          const v = {tenant: r.tenant, limits: lim(r), "in flight": r.in_flight,
                     "left this minute": [r.requests_left_this_minute != null ? r.requests_left_this_minute + " req" : null,
                                          r.tokens_left_this_minute != null ? r.tokens_left_this_minute + " tok" : null]
                                          .filter(Boolean).join(", ") || "-",
                     today: r.tokens_today ?? "-", "at limit": r.at_limit.join(", ") || "-"}[c];
          const cls = c === "at limit" && r.at_limit.length ? ' class="at-limit"' : "";
          return `<td${cls}>${escapeHtml(String(v))}</td>`;
        });
    } catch (e) {
      $("limits-table").replaceChildren();
      note(e.status === 401 || e.status === 403
        ? "Limits and throttling are shown to the admin key only."
        : `Limits: ${e.status || ""} ${e.message}`);
    }
  }

  $("usage-form").addEventListener("submit", (e) => { e.preventDefault(); load(); });
  $("usage-csv").addEventListener("click", async () => {
    showError("");
    try {
      const text = await (await request(query("csv"))).text();
      download($("usage-download"), `tokenmill-usage-${$("usage-from").value}-${$("usage-to").value}.csv`, text,
               "text/csv");
    } catch (e) {
      showError(`CSV: ${e.status || ""} ${e.message}`);
    }
  });
  return {
    enter() { if (!loaded) { loaded = true; load(); } },
    keyChanged() { loaded = false; $("usage-table").replaceChildren(); $("limits-table").replaceChildren(); },
  };
}
