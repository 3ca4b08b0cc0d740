// Writes the n8n credentials the outbox workflow refers to, as the JSON array
// `n8n import:credentials` reads (n8n encrypts the data on import), from the
// environment of the n8n-import service. Usage:
//   node n8n-credentials.js WORKFLOW.json OUT.json
// Each credential keeps the id and name the workflow's nodes name, so the
// imported workflow finds them. A credential type this script does not know
// is an error naming it.
"use strict";
const fs = require("fs");

const [workflowPath, outPath] = process.argv.slice(2);
if (!workflowPath || !outPath) {
  console.error("usage: node n8n-credentials.js WORKFLOW.json OUT.json");
  process.exit(2);
}

function env(name, fallback) {
  const v = process.env[name];
  if (v !== undefined && v !== "") return v;
  if (fallback !== undefined) return fallback;
  console.error(`n8n-credentials: ${name} is not set`);
  process.exit(1);
}

const data = {
  // The relay's webhook sink sends this header (auth.type: header).
  httpHeaderAuth: () => ({
    name: env("N8N_TOKEN_HEADER", "X-Outbox-Token"),
    value: env("N8N_TOKEN"),
  }),
  // The workflow's own claim table (deploy/n8n/tables.sql) lives here.
  postgres: () => ({
    host: env("OUTBOX_PG_HOST"),
    port: Number(env("OUTBOX_PG_PORT", "5432")),
    database: env("OUTBOX_PG_DATABASE"),
    user: env("OUTBOX_PG_USER"),
    password: env("OUTBOX_PG_PASSWORD"),
    ssl: env("OUTBOX_PG_SSL", "disable"),
  }),
};

const workflows = [].concat(JSON.parse(fs.readFileSync(workflowPath, "utf8")));
const byId = new Map();
for (const wf of workflows) {
  for (const node of wf.nodes || []) {
    for (const [type, ref] of Object.entries(node.credentials || {})) {
      if (!ref || !ref.id) {
        console.error(`n8n-credentials: node "${node.name}" refers to a ${type} credential without an id`);
        process.exit(1);
      }
      if (!data[type]) {
        console.error(`n8n-credentials: node "${node.name}" needs a ${type} credential; add the type to deploy/compose/n8n-credentials.js`);
        process.exit(1);
      }
      byId.set(ref.id, { id: ref.id, name: ref.name || ref.id, type });
    }
  }
}
const credentials = [...byId.values()].map((c) => ({ ...c, data: data[c.type]() }));
fs.writeFileSync(outPath, JSON.stringify(credentials, null, 2), { mode: 0o600 });
console.log(`n8n-credentials: ${credentials.map((c) => `${c.type} "${c.name}" (${c.id})`).join(", ") || "none needed"}`);
