// The one place the page talks to the server: same origin only, the key from sessionStorage as a Bearer token.
const KEY = "tokenmill.key";

export function getKey() { return sessionStorage.getItem(KEY) || ""; }
export function setKey(key) { key ? sessionStorage.setItem(KEY, key) : sessionStorage.removeItem(KEY); }

export class ApiError extends Error {
  constructor(status, message, code) { super(message); this.status = status; this.code = code; }
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = getKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The server's error, in OpenAI's shape, as an ApiError (never swallowed: the pages show its message).
async function failure(r) {
  let message = r.status + " " + r.statusText, code = null;
  try {
    const body = await r.json();
    if (body && body.error) { message = body.error.message || message; code = body.error.code || null; }
  } catch (e) { /* not JSON: the status line says it */ }
  return new ApiError(r.status, message, code);
}

export async function request(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const r = await fetch(path, opts);
  if (!r.ok) throw await failure(r);
  return r;
}

// `/` as API clients see it: {name, version, models?}; models only when the server takes no key at all.
export async function serverInfo() {
  const r = await fetch("/", {headers: {"Accept": "application/json"}});
  if (!r.ok) throw await failure(r);
  return r.json();
}

export async function getJSON(path) { return (await request(path)).json(); }
export async function getText(path) { return (await request(path)).text(); }

// POST a streaming body and call onEvent(object) for every SSE `data:` line until [DONE]; `signal` aborts it.
export async function streamSSE(path, body, onEvent, signal) {
  const r = await request(path, {method: "POST", body: JSON.stringify(body), signal,
                                 headers: {"Content-Type": "application/json", "Accept": "text/event-stream"}});
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new ApiError(event.error.status || 500, event.error.message, event.error.code);
        onEvent(event);
      }
    }
  }
}

// A download of text the page holds (a blob: URL of this page, nothing fetched elsewhere).
export function download(anchor, name, text, type) {
  if (anchor.href) URL.revokeObjectURL(anchor.href);
  anchor.href = URL.createObjectURL(new Blob([text], {type}));
  anchor.download = name;
  anchor.click();
}
