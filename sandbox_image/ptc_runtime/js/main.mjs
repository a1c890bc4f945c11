// A JavaScript or TypeScript script's process: `node main.mjs`, exec'd by a spare process the resident interpreter
// forked and confined ahead of the run (ptc_runtime/node.py). It prepares what it can (its module hooks, the tools
// runtime), then waits for the run's go on fd 3: {"env": {...}} or {"env_file": path} (the run's env, read here as the
// sandbox user) and "language". It then runs the run's script (/run/ptc/script.mjs or script.ts) as `node script.mjs`
// would run it: an ES module with top-level await; console.log and console.error write stdout and stderr;
// process.exit(n) is the exit code. Before the script, the manifest's tools are made globals (`tools`, `ToolError`,
// and each tool whose name is an identifier, not over a global that exists), as Cloudflare's and OpenAI's runtimes
// expose them.
//
// An uncaught exception or unhandled rejection ends the script with exit code 1, printed on stderr as Node prints
// it; a short description (type, message, line) goes to the broker as the script's report, which the job's view
// keeps apart from the verdict (the service trusts none of it).
import { spawnSync } from "node:child_process";
import { closeSync, readFileSync } from "node:fs";
import { createRequire, register } from "node:module";
import { inspect } from "node:util";
import { request } from "./client.mjs";
import "./tools.mjs";

const GO_FD = 3;
const RUN_DIR = "/run/ptc/";
const SCRIPTS = { javascript: "script.mjs", typescript: "script.ts" };
const EXIT_CANNOT_RUN = 126;

register("./hooks.mjs", import.meta.url);
noHomePackages();
await import("data:text/javascript,export default 1"); // the loader's dynamic-import path made ready (~4 ms of a run)

function noHomePackages() {
  // CommonJS's global folders without $HOME's (HOME is /tmp, where a session's earlier script may have left
  // .node_modules/<package>): `require` of an image's package is never code a script left, as PYTHONNOUSERSITE
  // keeps a Python script's ~/.local out. Node reads them once, at start-up; they are read again without HOME.
  const Module = createRequire(import.meta.url)("node:module");
  const home = process.env.HOME;
  delete process.env.HOME;
  try {
    Module._initPaths();
  } finally {
    if (home !== undefined) process.env.HOME = home;
  }
}

function waitForGo() {
  // The run's go (blocking until the server sends it; the process exits quietly when the server never does), its env
  // applied; returns the run's language.
  let message;
  try {
    message = JSON.parse(readFileSync(GO_FD, "utf8"));
    closeSync(GO_FD);
  } catch {
    process.exit(0);
  }
  if (message === null || typeof message !== "object") process.exit(0);
  let env = message.env;
  if (typeof message.env_file === "string") {
    try {
      env = JSON.parse(readFileSync(message.env_file, "utf8"));
    } catch (exc) {
      process.stderr.write(`ptc_runtime: cannot read the run's env: ${exc.message}\n`);
      process.exit(EXIT_CANNOT_RUN);
    }
  }
  if (env === null || typeof env !== "object") {
    process.stderr.write("ptc_runtime: the run's env is not an object\n");
    process.exit(EXIT_CANNOT_RUN);
  }
  for (const [name, value] of Object.entries(env)) process.env[name] = String(value);
  return message.language;
}

// stdout and stderr block when their pipe is full, as a Python script's print does: libuv writes a pipe at once
// while it has room and otherwise queues the rest in memory, so a script printing faster than the pipe drains
// (an endless console.log) would grow until the sandbox's memory limit ended it (oom_killed, not timed_out).
for (const stream of [process.stdout, process.stderr]) stream._handle?.setBlocking?.(true);

const language = waitForGo();
if (!Object.hasOwn(SCRIPTS, language)) {
  process.stderr.write(`ptc_runtime: this process runs no ${String(language).slice(0, 20)} scripts\n`);
  process.exit(EXIT_CANNOT_RUN);
}
const script = RUN_DIR + SCRIPTS[language];
const scriptName = SCRIPTS[language];
if (language === "typescript") process.setSourceMapsEnabled(true); // stack traces in the lines of the script as sent
process.argv[1] = script; // as `node script.mjs`: argv[1] is the script
const MESSAGE_CAP = 2000;
const write = process.stderr.write.bind(process.stderr);
const exit = process.exit.bind(process);

function scriptLine(error) {
  if (error !== null && typeof error === "object" && typeof error.ptcLine === "number") return error.ptcLine;
  let stack;
  try {
    stack = String(error?.stack ?? "");
  } catch {
    return null;
  }
  const escaped = scriptName.replace(/\./g, "\\.");
  const match = new RegExp(`${escaped}:(\\d+)(?::\\d+)?`).exec(stack);
  return match ? Number(match[1]) : null;
}

function describe(error) {
  let type = typeof error;
  let message = "";
  try {
    if (error instanceof Error || (error !== null && typeof error === "object" && "message" in error)) {
      type = String(error.name ?? error.constructor?.name ?? "Error");
      message = String(error.message ?? "");
    } else {
      type = error === null ? "null" : typeof error;
      message = inspect(error);
    }
  } catch {
    message = "<the thrown value could not be described>";
  }
  const report = { type: type.slice(0, 200), message: message.slice(0, MESSAGE_CAP), line: scriptLine(error) };
  if (typeof error?.ptcColumn === "number") report.column = error.ptcColumn;
  return report;
}

const RUNTIME_FRAME = /^\s+at .*(?:\/opt\/ptc\/ptc_runtime\/js\/|node:internal\/modules\/)/;

function withoutRuntimeFrames(error) {
  // The stack from the script's frames on: the runtime's and Node's module loader's frames left out (as
  // `node script.mjs` shows no frame of a main module that imported the script).
  try {
    if (error instanceof Error && typeof error.stack === "string") {
      error.stack = error.stack.split("\n").filter((line) => !RUNTIME_FRAME.test(line)).join("\n");
    }
  } catch {
    // a stack the script made unwritable: printed as it is
  }
}

function locateSyntaxError(error) {
  // A syntax error of the script's own module carries no location when the module is imported (Node 18 keeps it
  // for the message it prints at start-up only): ask `node --check`, which prints it, and keep its report.
  if (!(error instanceof SyntaxError) || !script.endsWith(".mjs") || scriptLine(error) !== null) return;
  const check = spawnSync(process.execPath, ["--check", script], { encoding: "utf8", timeout: 10000 });
  const report = check.stderr ?? "";
  const where = new RegExp(`${scriptName.replace(/\./g, "\\.")}:(\\d+)\n([^\n]*)\n( *)\\^`).exec(report);
  if (check.status === 0 || where === null) return;
  error.ptcLine = Number(where[1]);
  error.ptcColumn = where[3].length + 1;
  error.ptcReport = report.replace(/\n\s+at checkSyntax[^\n]*/, "").replace(/\n+Node\.js v[^\n]*\n?$/, "").trim();
}

function printed(error) {
  // What Node prints of an uncaught value: an error with stack frames through inspect (its own properties shown), one
  // without frames (a module's link error) as its stack text, not inspect's "[SyntaxError: ...]".
  if (error instanceof Error && typeof error.stack === "string" && !/\n\s+at /.test(error.stack)) return error.stack;
  return inspect(error);
}

let ending = false;
async function fail(error) {
  if (ending) return;
  ending = true;
  withoutRuntimeFrames(error);
  try {
    const text = typeof error?.ptcReport === "string" ? error.ptcReport : printed(error);
    write(`${text}\n\nNode.js ${process.version}\n`);
  } catch {
    write("Uncaught exception (it could not be printed)\n");
  }
  const stop = setTimeout(() => exit(1), 2000);
  try {
    await request({ op: "report", error: describe(error) });
  } finally {
    clearTimeout(stop);
    exit(1);
  }
}

process.on("uncaughtException", fail);
process.on("unhandledRejection", fail);

const tools = await import("tools");
for (const [name, value] of Object.entries({ tools: tools.default, ...tools })) {
  if (name !== "default" && !(name in globalThis)) {
    Object.defineProperty(globalThis, name, { value, writable: true, configurable: true, enumerable: false });
  }
}
let settled = false;
process.on("beforeExit", () => {
  // Nothing is left to run (no explicit exit) while the script's top-level await still waits: Node ends with 13.
  if (!settled && !ending) {
    write("Warning: the script's top-level await never settled: nothing was left to run (exit code 13, as Node)\n");
  }
});
try {
  await import(script);
  settled = true;
} catch (error) {
  settled = true;
  locateSyntaxError(error);
  await fail(error);
}
