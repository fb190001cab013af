// An MCP server that knows nothing of once-ledger, built on the TypeScript SDK
// (@modelcontextprotocol/sdk): the Node upstream once-proxy is tested in front of, over stdio
// (the default) or over Streamable HTTP with `--http PORT` (stateless: a server per request).
// Every order it places is one line appended to the file ORDERS_EFFECTS names, with the JSON-RPC
// id of the request it came in; while the file ORDERS_HOLD names exists, place_order waits after
// recording its effect. place_typed_order declares an output schema, and breaks it for an amount
// of 13 cents after its effect (the SDK's output validation runs after the tool).

import { appendFileSync, existsSync, readFileSync } from "node:fs";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import express from "express";
import { z } from "zod";

const effects: string = process.env.ORDERS_EFFECTS ?? "";
const hold: string = process.env.ORDERS_HOLD ?? "/nonexistent";

interface Placed {
  order_id: string;
  amount_cents: number;
  key: string;
  pid: number;
  request_id: string | number;
}

function placed(): Placed[] {
  if (!existsSync(effects)) return [];
  return readFileSync(effects, "utf8")
    .split("\n")
    .filter((line) => line.trim() !== "")
    .map((line) => JSON.parse(line))
    .filter((line) => "order_id" in line) as Placed[];
}

function orders(): McpServer {
  const server = new McpServer({ name: "orders-ts", version: "1.0.0" });

  server.registerTool(
    "place_order",
    {
      description: "Place an order: charges the customer.",
      inputSchema: {
        order_id: z.string(),
        amount_cents: z.number().int(),
        note: z.string().optional(),
        idempotency_key: z.string().optional(),
      },
    },
    async ({ order_id, amount_cents, idempotency_key }, extra) => {
      if (amount_cents <= 0) {
        return { content: [{ type: "text", text: `amount_cents must be positive, not ${amount_cents}` }], isError: true };
      }
      const order: Placed = { order_id, amount_cents, key: idempotency_key ?? "", pid: process.pid, request_id: extra.requestId };
      appendFileSync(effects, JSON.stringify(order) + "\n");
      while (existsSync(hold)) {
        if (extra.signal.aborted) {
          // The client's cancellation reached this server: say so where the tests look.
          appendFileSync(effects, JSON.stringify({ cancelled: order_id }) + "\n");
          throw new Error("cancelled");
        }
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      appendFileSync(effects, JSON.stringify({ answering: order_id }) + "\n");
      return { content: [{ type: "text", text: `order ${order_id} placed for ${amount_cents} cents (#${placed().length})` }] };
    },
  );

  server.registerTool(
    "place_typed_order",
    {
      description: "Place an order and return it as structured output.",
      inputSchema: { order_id: z.string(), amount_cents: z.number().int() },
      outputSchema: { order_id: z.string(), amount_cents: z.number().int() },
    },
    async ({ order_id, amount_cents }, extra) => {
      const order: Placed = { order_id, amount_cents, key: "", pid: process.pid, request_id: extra.requestId };
      appendFileSync(effects, JSON.stringify(order) + "\n");
      const structured: Record<string, unknown> = amount_cents === 13 ? { order_id } : { order_id, amount_cents };
      return { content: [{ type: "text", text: JSON.stringify(structured) }], structuredContent: structured };
    },
  );

  server.registerTool(
    "get_order",
    {
      description: "Look an order up.",
      inputSchema: { order_id: z.string() },
      annotations: { readOnlyHint: true },
    },
    async ({ order_id }) => {
      const found = placed().filter((o) => o.order_id === order_id);
      const text = found.length > 0 ? JSON.stringify(found[found.length - 1]) : "no such order";
      return { content: [{ type: "text", text }] };
    },
  );

  return server;
  }

  const http = process.argv.indexOf("--http");
  if (http === -1) {
    await orders().connect(new StdioServerTransport());
  } else {
    const app = express();
    app.use(express.json());
    app.post("/mcp", async (req, res) => {
      const server = orders();
      const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined });
      res.on("close", () => {
        void transport.close();
        void server.close();
      });
      await server.connect(transport);
      await transport.handleRequest(req, res, req.body);
    });
    const port = Number(process.argv[http + 1]);
    app.listen(port, "127.0.0.1");
  }
