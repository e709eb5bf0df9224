// The chat: streamed answers from /v1/chat/completions, kept in this browser.

import { setMarkdown } from "./markdown.js";

const STORE = {
  chat: "mlx-kvq.chat",
  settings: "mlx-kvq.settings",
  key: "mlx-kvq.api-key",
};
const $ = (id) => document.getElementById(id);

function load(name, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(name));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function save(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
  } catch {
    // storage full or disabled: the chat still works, it is just not kept
  }
}

/** Server-sent events from a fetch response: yields each `data:` payload. */
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

export class Chat {
  constructor() {
    this.messages = load(STORE.chat, { messages: [] }).messages || [];
    this.settings = load(STORE.settings, {});
    this.model = "default_model";
    this.defaults = {};
    this.controller = null;
    this.renderPending = new Set();
    this.status = null;

    this.list = $("messages");
    this.input = $("input");
    this.temperature = $("temperature");
    this.maxTokens = $("max-tokens");

    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.sendInput();
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.sendInput();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.newChat());
    for (const [input, name] of [[this.temperature, "temperature"], [this.maxTokens, "max_tokens"]]) {
      input.addEventListener("change", () => {
        if (input.value === "") delete this.settings[name];
        else this.settings[name] = Number(input.value);
        save(STORE.settings, this.settings);
      });
    }
    this.keyDialog = new KeyDialog();
    this.showSettings();
    this.renderAll();
  }

  // ------------------------------------------------------------ server state
  setStatus(status) {
    this.status = status;
    if (status) {
      this.model = status.model || this.model;
      this.defaults = status.defaults || {};
      this.showSettings();
    }
    const notice = $("notice");
    let text = "";
    if (!status) text = "The server does not answer; retrying.";
    else if (status.status === "warming_up") {
      text = "Warming up: the server is running every cache kind once in quantized form. " +
        "A message sent now is answered when it is ready.";
    } else if (status.status === "shutting_down") {
      text = `The server is shutting down (${status.reason || "no reason given"}).`;
    } else if (status.status === "failed") {
      text = `The engine failed: ${status.reason || "no reason given"}. Restart the server.`;
    } else if (["available", "loading", "evicting"].includes(status.status)) {
      text = `${status.model} is not in memory: a message sent now loads it first` +
        (status.reason ? ` (last time: ${status.reason})` : "") + ".";
    }
    notice.textContent = text;
    notice.hidden = !text;
    notice.dataset.state = status ? status.status : "unreachable";
    $("send").disabled = Boolean(status && ["failed", "shutting_down"].includes(status.status));
  }

  showSettings() {
    const t = this.settings.temperature ?? this.defaults.temperature;
    const m = this.settings.max_tokens ?? this.defaults.max_tokens;
    if (document.activeElement !== this.temperature) this.temperature.value = t ?? "";
    if (document.activeElement !== this.maxTokens) this.maxTokens.value = m ?? "";
  }

  // ------------------------------------------------------------ sending
  get busy() {
    return this.controller !== null;
  }

  async sendInput() {
    const text = this.input.value;
    if (this.busy || this.keyDialog.open || !text.trim() || $("send").disabled) return;
    if (this.status?.api_key_required && !localStorage.getItem(STORE.key)) {
      const key = await this.keyDialog.ask("This server requires an API key.");
      if (key === null) return;
    }
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.respond();
  }

  history() {
    return this.messages
      .filter((m) => m.role === "user" || (m.role === "assistant" && m.content))
      .map((m) => ({ role: m.role, content: m.content }));
  }

  async respond() {
    const messages = this.history();
    const reply = {
      role: "assistant", content: "", reasoning: "", tool_calls: [], chunks: 0, started: Date.now(),
    };
    this.messages.push(reply);
    this.setBusy(new AbortController());
    this.store();
    this.renderAll();
    const body = {
      model: this.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const t = Number(this.temperature.value);
    const m = Number(this.maxTokens.value);
    if (this.temperature.value !== "" && Number.isFinite(t)) body.temperature = t;
    if (this.maxTokens.value !== "" && Number.isFinite(m)) body.max_tokens = m;
    try {
      for (;;) {
        const response = await fetch("/v1/chat/completions", {
          method: "POST",
          headers: this.headers(),
          body: JSON.stringify(body),
          signal: this.controller.signal,
        });
        if (response.status === 401) {
          const refused = Boolean(localStorage.getItem(STORE.key));
          const key = await this.keyDialog.ask(refused
            ? "The server refused this API key. Enter the right one."
            : "This server requires an API key.");
          if (key === null) {
            reply.error = "This server requires an API key.";
            break;
          }
          continue;
        }
        if (!response.ok) {
          reply.error = await errorMessage(response);
          break;
        }
        await this.read(response, reply);
        break;
      }
    } catch (e) {
      if (e.name === "AbortError") reply.stopped = true;
      else reply.error = `The request failed: ${e.message}`;
    } finally {
      reply.finished = Date.now();
      this.setBusy(null);
      this.store();
      this.render(reply);
    }
  }

  async read(response, reply) {
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        continue;
      }
      if (chunk.error) {
        reply.error = chunk.error.message || JSON.stringify(chunk.error);
        continue;
      }
      if (chunk.usage) reply.usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      let got = false;
      if (delta.content) {
        reply.content += delta.content;
        got = true;
      }
      const reasoning = delta.reasoning ?? delta.reasoning_content;
      if (reasoning) {
        reply.reasoning += reasoning;
        got = true;
      }
      for (const call of delta.tool_calls || []) {
        const index = call.index ?? reply.tool_calls.length;
        const slot = reply.tool_calls[index] || (reply.tool_calls[index] = { id: "", name: "", arguments: "" });
        if (call.id) slot.id = call.id;
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
        got = true;
      }
      if (got) {
        reply.chunks += 1;
        reply.firstToken ??= Date.now();
      }
      if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
      this.scheduleRender(reply);
    }
  }

  headers() {
    const headers = { "Content-Type": "application/json" };
    const key = localStorage.getItem(STORE.key);
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  newChat() {
    this.stop();
    this.messages = [];
    this.store();
    this.renderAll();
    this.input.focus();
  }

  setBusy(controller) {
    this.controller = controller;
    $("stop").hidden = !controller;
    $("send").hidden = Boolean(controller);
  }

  store() {
    save(STORE.chat, { messages: this.messages });
  }

  // ------------------------------------------------------------ rendering
  scheduleRender(message) {
    if (this.renderPending.has(message)) return;
    this.renderPending.add(message);
    requestAnimationFrame(() => {
      this.renderPending.delete(message);
      this.render(message);
    });
  }

  renderAll() {
    this.list.replaceChildren();
    for (const message of this.messages) {
      delete message.element;
      this.render(message);
    }
    $("empty").hidden = this.messages.length > 0;
  }

  render(message) {
    if (!this.messages.includes(message)) return; // a reply that "New chat" dropped
    let li = message.element;
    if (!li || !li.isConnected) {
      li = document.createElement("li");
      li.className = `message ${message.role}`;
      Object.defineProperty(message, "element", { value: li, enumerable: false, configurable: true, writable: true });
      this.list.appendChild(li);
      $("empty").hidden = true;
    }
    li.replaceChildren();
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = message.role === "user" ? "you" : this.model;
    li.appendChild(role);

    if (message.role === "user") {
      const text = document.createElement("div");
      text.className = "content plain";
      text.textContent = message.content;
      li.appendChild(text);
      return;
    }
    const streaming = this.busy && message === this.messages[this.messages.length - 1];
    li.classList.toggle("streaming", streaming);
    li.dataset.chunks = String(message.chunks || 0);
    li.dataset.done = String(Boolean(message.finished));
    if (message.reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = streaming && !message.content ? "Thinking…" : "Reasoning";
      const body = document.createElement("div");
      body.className = "markdown";
      setMarkdown(body, message.reasoning);
      details.append(summary, body);
      li.appendChild(details);
    }
    const content = document.createElement("div");
    content.className = "content markdown";
    setMarkdown(content, message.content);
    li.appendChild(content);
    for (const call of message.tool_calls || []) {
      if (!call) continue;
      const box = document.createElement("div");
      box.className = "tool-call";
      const head = document.createElement("div");
      head.className = "tool-name";
      head.textContent = `tool call: ${call.name || "(unnamed)"}`;
      const args = document.createElement("pre");
      try {
        args.textContent = JSON.stringify(JSON.parse(call.arguments), null, 2);
      } catch {
        args.textContent = call.arguments;
      }
      box.append(head, args);
      li.appendChild(box);
    }
    if (message.error) {
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = message.error;
      li.appendChild(error);
    }
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = this.describe(message, streaming);
    li.appendChild(meta);
    if (streaming) this.list.parentElement.scrollTop = this.list.parentElement.scrollHeight;
  }

  describe(message, streaming) {
    if (streaming) return message.chunks ? "streaming…" : "waiting for the first token…";
    const parts = [];
    const usage = message.usage;
    if (usage) {
      parts.push(`${usage.completion_tokens} tokens`);
      const seconds = (message.finished - (message.firstToken || message.started)) / 1000;
      if (seconds > 0 && usage.completion_tokens > 1) {
        parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
      }
      const cached = usage.prompt_tokens_details?.cached_tokens;
      parts.push(`prompt ${usage.prompt_tokens}` + (cached ? ` (${cached} cached)` : ""));
    }
    if (message.finish_reason) parts.push(`finish: ${message.finish_reason}`);
    if (message.stopped) parts.push("stopped");
    return parts.join(" · ");
  }
}

/** The API-key dialog; the key stays in this browser's localStorage. */
class KeyDialog {
  constructor() {
    this.dialog = $("key-dialog");
    this.input = $("key-input");
    this.resolve = null;
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = this.input.value.trim();
      if (!key) return;
      localStorage.setItem(STORE.key, key);
      this.close(key);
    });
    $("key-cancel").addEventListener("click", () => this.close(null));
    $("key-forget").addEventListener("click", () => {
      localStorage.removeItem(STORE.key);
      this.close(null);
    });
    this.dialog.addEventListener("cancel", () => this.close(null));
    $("key-button").addEventListener("click", () => this.ask("API key for this server."));
    $("key-button").hidden = !localStorage.getItem(STORE.key);
  }

  get open() {
    return this.dialog.open;
  }

  ask(message) {
    $("key-message").textContent = message;
    this.input.value = "";
    if (!this.dialog.open) this.dialog.showModal();
    this.input.focus();
    return new Promise((resolve) => {
      this.resolve = resolve;
    });
  }

  close(key) {
    if (this.dialog.open) this.dialog.close();
    $("key-button").hidden = !localStorage.getItem(STORE.key);
    const resolve = this.resolve;
    this.resolve = null;
    if (resolve) resolve(key);
  }
}
