// The KV panel: polls /status and shows the plan, the bytes held, the budget
// (when the server has one) and the engine's numbers; with several models, of
// the one picked (the picker lists them and where each is).

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const $ = (id) => document.getElementById(id);

export function formatBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 2 : 1)} ${units[unit]}`;
}

function bits(value) {
  return value === null || value === undefined ? "16" : String(value);
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function renderPlan(plan) {
  $("plan-summary").textContent = plan.summary || "";
  const kv = plan.kv_config || {};
  const keyBits = kv.key_bits ?? kv.bits;
  const valueBits = kv.value_bits ?? kv.bits;
  const perToken = plan.fp16_bytes_per_token
    ? ` (${(plan.bytes_per_token / plan.fp16_bytes_per_token).toFixed(2)}x of 16-bit)` : "";
  $("plan-config").textContent =
    `keys ${keyBits ? keyBits + "-bit" : "16-bit"}, values ${valueBits ? valueBits + "-bit" : "16-bit"}` +
    (kv.window_bits !== null && kv.window_bits !== undefined
      ? `, bounded layers ${kv.window_bits ? kv.window_bits + "-bit" : "16-bit"}` : "") +
    (keyBits || valueBits ? `, group ${kv.group_size}, rotation ${kv.rotation}` : "") +
    (kv.quantized_kv_start ? `, quantized from token ${kv.quantized_kv_start}` : "") +
    `; ${plan.bytes_per_token} bytes per token${perToken}`;

  const body = $("plan-table").tBodies[0];
  body.replaceChildren();
  for (const slot of plan.slots || []) {
    const row = document.createElement("tr");
    row.dataset.slot = slot.member === null || slot.member === undefined
      ? String(slot.slot) : `${slot.slot}.${slot.member}`;
    row.dataset.kind = slot.kind;
    cell(row, row.dataset.slot + (slot.rank !== undefined ? ` (rank ${slot.rank})` : ""));
    cell(row, slot.kind, "kind");
    cell(row, slot.window ?? "-");
    if (slot.kv) {
      cell(row, bits(slot.key_bits), "key-bits");
      cell(row, bits(slot.value_bits), "value-bits");
      cell(row, slot.rotation || "none");
      cell(row, Math.round(slot.bytes_per_token).toLocaleString("en-US"));
      if (slot.quantized) {
        cell(row, slot.hand_out === "dequantized" ? "quantized*" : "quantized", "storage ok")
          .title = slot.label || "";
      } else {
        row.classList.add("unquantized");
        cell(row, "UNQUANTIZED", "storage alarm").title = slot.label || "";
      }
    } else {
      for (let i = 0; i < 4; i += 1) cell(row, "-");
      cell(row, "not KV", "storage").title = slot.label || "";
    }
    body.appendChild(row);
  }

  const unquantized = (plan.slots || []).filter((s) => s.kv && !s.quantized);
  const alarm = $("unquantized-alarm");
  alarm.hidden = unquantized.length === 0;
  alarm.textContent = unquantized.length
    ? `${unquantized.length} of ${plan.kv_layers} KV slots are UNQUANTIZED ` +
      `(slot ${unquantized.map((s) => s.slot).join(", ")}): they hold 16-bit keys and values.`
    : "";
  const notes = [];
  if (plan.shared_layers) {
    notes.push(`${plan.shared_layers} more layers reuse an earlier layer's keys and values (KV-shared).`);
  }
  if (plan.sinks) notes.push("Attention sinks are handled by quantized attention.");
  if (plan.slots && plan.slots.some((s) => s.hand_out === "dequantized")) {
    notes.push("* stored quantized, handed to this model's attention dequantized.");
  }
  for (const note of plan.notes || []) notes.push(note);
  $("plan-notes").textContent = notes.join(" ");
}

function renderKinds(kv, promptCache) {
  const box = $("kv-kinds");
  box.replaceChildren();
  const total = kv.bytes || 0;
  const cached = promptCache.bytes || 0;
  const scale = total + cached;
  for (const [kind, bytes] of Object.entries(kv.by_kind || {})) {
    const row = document.createElement("div");
    row.className = "kind-row";
    row.dataset.kind = kind;
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = kind;
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.width = scale ? `${(100 * bytes) / scale}%` : "0%";
    bar.appendChild(fill);
    const value = document.createElement("span");
    value.className = "value";
    value.textContent = formatBytes(bytes);
    row.append(name, bar, value);
    box.appendChild(row);
  }
  $("kv-total").textContent = formatBytes(total);
  $("kv-cache").textContent = formatBytes(cached);
  $("kv-cache-fill").style.width = scale ? `${(100 * cached) / scale}%` : "0%";
}

function renderBudget(budget) {
  const section = $("budget");
  section.hidden = !budget;
  if (!budget) return;
  const size = budget.bytes || 0;
  const live = budget.live || 0;
  const reserved = Math.max((budget.reserved || 0) - live, 0);
  const cache = budget.prompt_cache || 0;
  const share = (n) => (size ? `${Math.min(100, (100 * n) / size)}%` : "0%");
  $("budget-live").style.width = share(live);
  $("budget-reserved").style.width = share(reserved);
  $("budget-cache").style.width = share(cache);
  $("budget-bytes").textContent = formatBytes(size);
  $("budget-use").textContent = `${formatBytes(live)} / ${formatBytes(budget.reserved || 0)}`;
  $("budget-prompt-cache").textContent = formatBytes(cache);
  $("budget-sequences").textContent =
    `${budget.admitted || 0} admitted, ${budget.waiting || 0} waiting`;
  $("budget-preemptions").textContent =
    `${budget.preemptions || 0} times, ${budget.resumptions || 0} resumed, ` +
    `${budget.preempted || 0} waiting to resume`;
  $("budget-capacity").textContent = budget.capacity || "";
}

function renderBlocks(blocks) {
  $("budget-blocks").textContent = blocks
    ? `${blocks.used} used, ${blocks.free} free, ${blocks.shared} shared ` +
      `(${blocks.block_size}-token blocks); ${blocks.prefix_blocks_reused} prefix blocks reused`
    : "padded rows (not paged)";
}

function renderEngine(s) {
  const tps = s.tokens_per_second || {};
  $("stat-generation-tps").textContent = `${(tps.generation || 0).toFixed(1)} tok/s`;
  $("stat-prompt-tps").textContent = `${(tps.prompt || 0).toFixed(1)} tok/s`;
  $("stat-queue-depth").textContent = String(s.queue_depth);
  $("stat-batch-size").textContent = `${s.batch_size} (max ${s.max_batch_size})`;
  $("stat-requests").textContent = Object.entries(s.requests || {})
    .filter(([name, n]) => n || name === "ok" || name === "cancelled")
    .map(([name, n]) => `${n} ${REQUEST_WORDS[name] || name}`)
    .join(", ");
  const pc = s.prompt_cache || {};
  $("stat-prompt-cache").textContent =
    `${pc.entries}/${pc.max_entries} entries, ${formatBytes(pc.bytes)}` +
    (pc.max_bytes ? ` of ${formatBytes(pc.max_bytes)}` : "");
  $("stat-hit-rate").textContent = pc.hit_rate === null || pc.hit_rate === undefined
    ? "-" : `${(100 * pc.hit_rate).toFixed(0)}% (${pc.hits} of ${pc.hits + pc.misses}), ` +
      `${pc.cached_tokens} tokens reused`;
  const disk = s.prompt_cache_disk;
  $("stat-disk-label").hidden = $("stat-disk").hidden = !disk;
  if (disk) {
    const skipped = Object.values(disk.skips || {}).reduce((a, b) => a + b, 0);
    $("stat-disk").textContent =
      `${formatBytes(disk.bytes)} of ${formatBytes(disk.max_bytes)}, ${disk.entries} entries; ` +
      `${disk.hits} hits, ${disk.misses} misses, ${disk.tokens_read} tokens read; ` +
      `${disk.writes} files written, ${skipped} skipped`;
    $("stat-disk").title = `${disk.directory}: skipped ${JSON.stringify(disk.skips || {})}`;
  }
  const m = s.memory || {};
  $("stat-memory").textContent = `${formatBytes(m.active)} (peak ${formatBytes(m.peak)})`;
  $("stat-blas").textContent = s.blas ? (s.blas.name || JSON.stringify(s.blas)) : "unknown";
}

const STATE_WORDS = {
  warming_up: "warming up",
  ready: "ready",
  shutting_down: "shutting down",
  failed: "failed",
  unreachable: "server unreachable",
  available: "not loaded",
  loading: "loading",
  evicting: "unloading",
};

/** The model picker: shown when the server has several models. */
function renderModels(models, current) {
  const picker = $("model-picker");
  const several = (models || []).length > 1;
  $("model-choice").hidden = !several;
  $("model").hidden = several;
  if (!several) return;
  const names = models.map((m) => m.name).join("\n");
  if (picker.dataset.names !== names) {
    picker.replaceChildren(...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.name;
      return option;
    }));
    picker.dataset.names = names;
  }
  models.forEach((m, i) => {
    const where = STATE_WORDS[m.status] || m.status;
    picker.options[i].textContent = `${m.name}${m.default ? " (default)" : ""}: ${where}`;
  });
  if (document.activeElement !== picker) picker.value = current;
}
const REQUEST_WORDS = { error: "failed", rejected: "refused" };

function renderState(state, reason) {
  const badge = $("state");
  badge.dataset.state = state;
  badge.textContent = STATE_WORDS[state] || state;
  badge.title = reason || "";
}

/** Poll /status (of the model picked) forever; `listener(status or null)` after each poll. */
export function startPanel(listener) {
  let planShown = null;
  let picked = null; // the model picked on the page; null: the server's default
  let timer = null;
  $("model-picker").addEventListener("change", (e) => {
    picked = e.target.value;
    clearTimeout(timer);
    poll();
  });
  async function poll() {
    let status = null;
    const url = picked === null ? "/status" : `/status?model=${encodeURIComponent(picked)}`;
    try {
      const response = await fetch(url, { cache: "no-store" });
      if (response.ok) status = await response.json();
    } catch {
      status = null;
    }
    if (status) {
      $("model").textContent = status.model;
      document.title = `${status.model} · mlx-kvq`;
      renderModels(status.models, status.model);
      renderState(status.status, status.reason);
      const planKey = JSON.stringify(status.plan);
      if (planKey !== planShown) {
        renderPlan(status.plan);
        planShown = planKey;
      }
      renderKinds(status.kv, status.prompt_cache || {});
      renderBudget(status.budget);
      renderBlocks(status.blocks);
      renderEngine(status);
    } else {
      renderState("unreachable", "GET /status failed; retrying");
    }
    listener(status);
    timer = setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }
  poll();
}
