// The page: a chat with the served model beside what its KV caches hold.
import { Chat } from "./chat.js";
import { startPanel } from "./panel.js";

const chat = new Chat();
startPanel((status) => chat.setStatus(status));
