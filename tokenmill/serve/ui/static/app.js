// The console's shell: the tabs (one page per hash), and the key, typed once and kept in sessionStorage.
import {getKey, setKey} from "/ui/api.js";
import {initChat} from "/ui/chat.js";
import {initLive} from "/ui/live.js";
import {initUsage} from "/ui/usage.js";
import {initBench} from "/ui/bench.js";

const pages = {chat: initChat(), live: initLive(), usage: initUsage(), bench: initBench()};
let current = null;

function show() {
  const name = (location.hash || "#chat").slice(1);
  const page = pages[name] ? name : "chat";
  for (const [n, p] of Object.entries(pages)) {
    document.getElementById("page-" + n).hidden = n !== page;
    if (n !== page && n === current && p.leave) p.leave();
  }
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.page === page);
  current = page;
  if (pages[page].enter) pages[page].enter();
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
  if (pages[current].enter) pages[current].enter();
});
document.getElementById("key-forget").addEventListener("click", () => {
  setKey("");
  showKeyState();
  for (const p of Object.values(pages)) if (p.keyChanged) p.keyChanged();
  if (pages[current].enter) pages[current].enter();
});
window.addEventListener("hashchange", show);
showKeyState();
show();
