// The console's shell: the tabs (one page per hash), and the key, typed once and kept in sessionStorage.
import {getKey, serverInfo, setKey} from "/ui/api.js";
import {initChat} from "/ui/chat.js";
import {initLive} from "/ui/live.js";
import {initUsage} from "/ui/usage.js";
import {initBench} from "/ui/bench.js";

const pages = {chat: initChat(), live: initLive(), usage: initUsage(), bench: initBench()};
let current = null;
let needsKey = true;

// Without a key a server with keys would only answer 401: ask for one first instead of calling it.
function enter(page) {
  const missing = needsKey && !getKey();
  const banner = document.getElementById("key-needed");
  banner.hidden = !missing;
  if (!missing && pages[page].enter) pages[page].enter();
}

function show() {
  const name = (location.hash || "#chat").slice(1);
  const page = pages[name] ? name : "chat";
  for (const [n, p] of Object.entries(pages)) {
    document.getElementById("page-" + n).hidden = n !== page;
    if (n !== page && n === current && p.leave) p.leave();
  }
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.page === page);
  current = page;
  enter(page);
}

function showKeyState() {
  const key = getKey();
  document.getElementById("key-state").textContent = key ? "key set (…" + key.slice(-4) + ")" : "no key";
}

document.getElementById("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.getElementById("key-input");
  setKey(input.value.trim());
  input.value = "";
  showKeyState();
  for (const p of Object.values(pages)) if (p.keyChanged) p.keyChanged();
  if (current) enter(current);
});
document.getElementById("key-forget").addEventListener("click", () => {
  setKey("");
  showKeyState();
  for (const p of Object.values(pages)) if (p.keyChanged) p.keyChanged();
  if (current) enter(current);
});
window.addEventListener("hashchange", show);
showKeyState();
serverInfo().then((info) => { needsKey = !info.models; }, () => { needsKey = true; }).finally(show);
